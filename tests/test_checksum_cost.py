"""scripts/checksum_cost.py: the CRC-32 throughput and the 175B save and load times it prints."""

from __future__ import annotations

from tests.runs import load_script


def test_prints_the_175b_times_with_the_checksum_share(capsys):
    assert load_script("checksum_cost").main(["--mib", "4", "--bandwidth-gbs", "2"]) == 0
    out = capsys.readouterr().out
    assert "175B checkpoint: 174.6B parameters x 12 B = 2.10 TB" in out
    for row in ("| save, each rank its share |", "| load, each rank its share |", "| rank 0 reads and checksums all |"):
        assert row in out
