"""What an adversarial user finds: each test names a case that ended in a traceback, a misleading line or
a silently impossible figure, and checks what kvt does now (one KvtError line, or a repaired result)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvt
from kvt.harness import bench as B
from kvt.harness import pipeline as run
from kvt.harness.report import write_atomic
from kvt.config import KvtError
from kvt.harness.bench import random_mapper
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


def test_integer_weights_are_refused_from_the_header(tmp_path):
    """Bug: an int8 embedding (a quantized export without quantization_config) was cast to float on load and
    the run died later in a ZeroDivisionError traceback. The header's dtype is checked before allocating."""
    folder = tmp_path / "toy-m"
    shutil.copytree(ROOT / "weights" / "toy-m", folder)
    t = load_file(folder / "model.safetensors")
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.int8)
    save_file(t, folder / "model.safetensors")
    with pytest.raises(KvtError, match="embed_tokens.weight is stored as I8, not a float type.*use the original weights"):
        kvt.load_model(folder)


def test_nan_weights_are_refused_at_load(tmp_path):
    """Bug: a checkpoint with a NaN weight (a damaged file) loaded silently and the run reported scores of
    a model that outputs NaN. load_weights checks each block as it copies it."""
    folder = tmp_path / "toy-m"
    shutil.copytree(ROOT / "weights" / "toy-m", folder)
    t = load_file(folder / "model.safetensors")
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, folder / "model.safetensors")
    with pytest.raises(KvtError, match="layers.1.mlp.up_proj.weight holds NaN or infinite values.*download it again"):
        kvt.load_model(folder)


def test_a_config_larger_than_its_weights_is_refused_before_the_memory_plan(tmp_path):
    """Bug: kvt run with a config.json of vocab_size 10^9 over a 640-token checkpoint said "memory plan does
    not fit: 357.6 GiB ... use devices with more memory": the plan read the config's sizes before anything
    compared them with the weights. The headers are compared first now."""
    folder = tmp_path / "toy-m"
    shutil.copytree(ROOT / "weights" / "toy-m", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 10 ** 9}))
    with pytest.raises(KvtError, match=r"embed_tokens.weight has shape \(640, 96\), config.json implies \(1000000000, 96\)"):
        run.main(["--source", str(ROOT / "weights" / "toy-s"), "--target", str(folder), "--out", str(tmp_path / "out"),
                  *SMALL_RUN])


def test_a_tokenizer_config_that_is_not_an_object_is_refused(tmp_path):
    """Bug: tokenizer_config.json holding a list ended in AttributeError "'list' object has no attribute 'get'"."""
    folder = tmp_path / "toy-m"
    shutil.copytree(ROOT / "weights" / "toy-m", folder)
    (folder / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(KvtError, match="tokenizer_config.json holds a list, not an object.*download"):
        kvt.load_tokenizer(folder)


@pytest.mark.parametrize("option", ["--weights", "--data-dir"])
def test_a_file_given_for_a_folder_option_is_refused(tmp_path, option):
    """Bug: --weights FILE said "no checkpoint folder FILE/toy-s; get it with: python -m kvt.harness.toy train --out FILE"
    (a command that cannot work), --data-dir FILE "missing FILE/arc_easy/test.jsonl: write it with ..."."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(KvtError, match=f"{option} {tmp_path / 'afile'} is a file; give the folder that holds"):
        run.main([option, str(tmp_path / "afile"), "--out", str(tmp_path / "out"), *SMALL_RUN])


def test_a_report_that_cannot_be_written_is_one_line(tmp_path):
    """Bug: a folder named report.md in the run folder ended the (finished) run in an IsADirectoryError
    traceback. One line now, saying what to move; the rerun then only writes the report."""
    (tmp_path / "report.md").mkdir()
    with pytest.raises(KvtError, match="cannot write .*report.md .*move it away and run again"):
        write_atomic(tmp_path / "report.md", "x")
