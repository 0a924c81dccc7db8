"""dtgpt's one-process run against a pinned trajectory from an independent implementation.

tests/data/reference_trajectory.json holds the losses of 20 fp32 iterations of
scripts/reference_gpt.py (a plain GPT and loop that run none of dtgpt's model, loss or step:
whole global batch at once, torch's AdamW and clipping, the LR schedule written out), with the
command that made it and the train.py overrides of the same run. Every layout is checked
against the one-process run elsewhere; this checks the one-process run itself, so a bug that
all layouts share (the loss normaliser, init, optimizer groups, LR schedule) fails here.
"""

from __future__ import annotations

import json

import pytest

from tests.runs import REPO, train_losses

PINNED = json.loads((REPO / "tests/data/reference_trajectory.json").read_text())


def test_one_process_matches_the_pinned_reference_trajectory(tmp_path):
    # relative 1e-5 (DESIGN invariant 1): the two sum the same fp32 numbers in another order
    # (8 micro-batches of 1 here, one batch of 8 there), nothing more.
    losses = train_losses(tmp_path, PINNED["dtgpt_overrides"], base=[])
    assert len(losses) == len(PINNED["losses"]) == 20
    assert losses == pytest.approx(PINNED["losses"], rel=1e-5)
