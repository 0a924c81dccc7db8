"""scripts/generate.py on a folder that is not a checkpoint: one error line with a fix that
applies to generation (not the trainer's checkpoint.auto_resume)."""

import subprocess
import sys

from tests.runs import REPO


def test_generate_on_a_folder_without_checkpoint_says_what_to_give(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/generate.py"), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert "holds no complete checkpoint" in lines[0] and "give a checkpoint.save directory" in lines[0]
    assert "auto_resume" not in lines[0]
