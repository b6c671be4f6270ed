"""What an adversarial user finds: each test names a case that ended in a traceback, a misleading line or
a silently impossible figure, and checks what kvt does now (one KvtError line, or a repaired result)."""
from pathlib import Path

import pytest

from kvt import bench as B
from kvt import pipeline as run
from kvt.config import KvtError
from kvt.bench import random_mapper
from tests.conftest import ROOT
from tests.test_bench import LARGE, SMALL


def test_a_last_step_shorter_than_the_noise_gets_a_dash_not_a_negative_rate():
    """Bug: the default report printed `last step GB/s` -0.9 and `at prefill's rate` -25.0x when a round's
    transfer took less than its map (noise on loaded cores). A rate is never negative: both are None in
    the row, a dash in the table, with a line saying why."""
    fwd, n = random_mapper(SMALL, LARGE, k=2), 16
    row = B.rows({"s": {n: B.Timing([1.0, 1.0, 1.0])}, "l": {n: B.Timing([10.0, 10.0, 10.0])}},
                 {("s", "l"): {n: B.Timing([0.30, 0.31, 0.29])}}, {("s", "l"): fwd}, "cpu",
                 mapping={("s", "l"): {n: B.Timing([0.32, 0.30, 0.33])}}, itemsize={("s", "l"): 4})[0]
    assert row["last_gbs"] is None and row["rate_limit"] is None
    table = B.format_rows([row])
    header, _, cells = (line.split(" | ") for line in table.splitlines()[:3])
    shown = dict(zip(header, cells))
    assert shown["at prefill's rate"] == "-" and shown["last step GB/s"] == "-", shown
    assert "not positive" in table


SMALL_RUN = ["--tasks", "toy_recall", "--limit", "3", "--calib-seqs", "6", "--calib-len", "64", "--no-bench", "--k", "2"]


def toy_run(out, *extra):
    return ["--source", str(ROOT / "weights" / "toy-s"), "--target", str(ROOT / "weights" / "toy-m"), "--out", str(out),
            *SMALL_RUN, *extra]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc: a folder nobody can write in, root included")
def test_an_output_folder_that_takes_no_files_is_refused_before_calibration():
    """Bug: --out naming an existing folder that cannot be written (read-only) calibrated first, then died
    with a SafetensorError traceback saving the statistics. Refused up front now, with what to do."""
    with pytest.raises(KvtError, match="cannot write in the output folder /proc/self .*choose another --out"):
        run.main(toy_run("/proc/self"))
