"""What an adversarial user finds: each test names a case that ended in a traceback, a misleading line or
a silently impossible figure, and checks what kvt does now (one KvtError line, or a repaired result)."""
import pytest

from kvt import bench as B
from kvt.bench import random_mapper
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
