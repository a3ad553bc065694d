"""``kvtier probe --disk``: a bounded read test of the disk under a directory, its file always removed."""

from __future__ import annotations

import os

import pytest

from kvtier.cli.disk_probe import probe_disk


def test_the_disk_probe_reports_reads_and_checksums_and_leaves_nothing(tmp_path):
    rows = dict(probe_disk(str(tmp_path), 256))
    for threads in ("1 thread", "4 threads", "8 threads"):
        assert rows[f"disk read, {threads}"].endswith("GB/s (cold)")
        assert float(rows[f"page checksum, {threads}"].split()[0]) > 0
    assert "256 MiB" in rows["disk write"]
    tier = rows["disk tier read"]  # 64 pages written by one manager, read back by the next
    assert float(tier.split()[0]) > 0 and "of the best raw read" in tier
    assert list(tmp_path.iterdir()) == []


def test_the_disk_probe_reads_the_tier_with_each_thread_count_and_names_the_fastest(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DISK_IO_THREADS", "2")  # not a count the raw reads try
    rows = dict(probe_disk(str(tmp_path), 256))
    assert "2 I/O threads" in rows["disk tier read"]
    tier = {2: float(rows["disk tier read"].split()[0])}
    for n in (1, 4, 8):
        row = rows[f"disk tier read, KVTIER_DISK_IO_THREADS={n}"]
        assert f" {n} I/O thread" in row and "of the best raw read" in row
        tier[n] = float(row.split()[0])
    advice = rows.get("disk I/O threads")
    if advice is not None:  # another count beat the configured one (as printed, two decimals)
        fastest = int(advice.rsplit("=", 1)[1])
        assert advice.startswith("2 now") and fastest != 2 and tier[fastest] == max(tier.values())
    else:
        assert tier[2] == max(tier.values())
    assert os.environ["KVTIER_DISK_IO_THREADS"] == "2"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mib", [0, 255, 4097])
def test_the_disk_probe_refuses_sizes_out_of_bounds(tmp_path, mib):
    with pytest.raises(ValueError, match="--disk-mib"):
        probe_disk(str(tmp_path), mib)
    assert list(tmp_path.iterdir()) == []


def test_the_disk_probe_refuses_a_path_that_is_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        probe_disk(str(tmp_path / "missing"), 256)
