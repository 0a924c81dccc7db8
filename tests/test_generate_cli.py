"""scripts/generate.py on a folder that is not a checkpoint: one error line with a fix that
applies to generation (not the trainer's checkpoint.auto_resume)."""

import importlib.util
import subprocess
import sys

import pytest

from tests.runs import REPO


@pytest.mark.slow
def test_generate_on_a_folder_without_checkpoint_says_what_to_give(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/generate.py"), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert "holds no complete checkpoint" in lines[0] and "give a checkpoint.save directory" in lines[0]
    assert "auto_resume" not in lines[0]


BAD_ARGUMENTS = {
    "--max-new-tokens=-5": "--max-new-tokens=-5 must be >= 0",
    "--temperature=nan": "--temperature=nan must be a finite number >= 0",
    "--temperature=-1": "--temperature=-1.0 must be a finite number >= 0 (0: greedy)",
    "--top-k=-3": "--top-k=-3 must be >= 0",
    "--iteration=-2": "--iteration=-2 must be >= 0",
    f"--seed={2**70}": "must be in [0, 2**63)",
}


def test_sampling_arguments_that_make_no_sense_are_one_error_line(tmp_path, capfd):
    """Checked before anything is loaded; each would otherwise mean something else silently
    (a negative top-k: every token; a negative temperature: greedy) or end in a traceback."""
    spec = importlib.util.spec_from_file_location("generate", REPO / "scripts/generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    for argument, message in BAD_ARGUMENTS.items():
        assert generate.main([str(tmp_path), argument]) == 2, argument
        lines = capfd.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (argument, lines)


def test_a_prompt_the_tokenizer_refuses_is_one_error_line(tmp_path, capfd, monkeypatch):
    """A NullTokenizer's prompt is its ids: words, or ids past the vocabulary, were a traceback.
    The prompt is read before the model is loaded."""
    from dtgpt.config import Config

    spec = importlib.util.spec_from_file_location("generate", REPO / "scripts/generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    cfg = Config()
    cfg.data.tokenizer_type, cfg.data.vocab_size = "NullTokenizer", 128
    monkeypatch.setattr(generate, "find_checkpoint", lambda path, iteration: tmp_path)
    monkeypatch.setattr(generate, "read_config", lambda directory, path: cfg)
    monkeypatch.setattr(generate, "load_model", lambda directory, cfg: pytest.fail("the model loaded before the prompt was read"))
    refused = {
        "def ": "--prompt 'def ': NullTokenizer: text must be space-separated integers",
        "1 2 999": "--prompt '1 2 999': NullTokenizer: ids [999] are outside [0, 128)",
    }
    for prompt, message in refused.items():
        assert generate.main([str(tmp_path), "--prompt", prompt]) == 2, prompt
        lines = capfd.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), (prompt, lines)
