"""Where checkpoints are found: ./weights and, for a named shape, the Hugging Face cache that `hf download`
fills (blobs/ with links from snapshots/<commit>/, refs/main, sharded bf16 safetensors with an index), read
as plain files. The tiny Qwen3 pair is conftest.hub_cache."""
import pytest
import torch

import kvt
from kvt.config import KvtError, checkpoint_name, find_weights
from kvt.harness.pipeline import parse_args, resolve


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No ./weights, no cache variables and an empty home: only what a test points at is found."""
    monkeypatch.chdir(tmp_path)
    for var in ("HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


@pytest.mark.parametrize("how", ["HF_HUB_CACHE", "HF_HOME", "home"])
def test_pair_is_found_in_the_hub_cache_and_loads(hub_cache, nowhere, monkeypatch, how):
    """Bug: --pair looked in ./weights only, and a user who ran `hf download Qwen/Qwen3-14B` was told to
    download it again. Each way the hub client picks its cache finds the snapshot refs/main names, and the
    linked, sharded bf16 checkpoint loads exactly, with Qwen3's two end tokens from generation_config.json."""
    home, repos = hub_cache
    if how == "HF_HUB_CACHE":
        monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    elif how == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(home))
    else:
        (nowhere / "home" / ".cache").mkdir(parents=True)
        (nowhere / "home" / ".cache" / "huggingface").symlink_to(home)
    src, tgt, src_name, tgt_name = resolve(parse_args(["--pair", "qwen3-14b:32b"]))
    assert (src_name, tgt_name) == ("qwen3-14b", "qwen3-32b")
    for path, repo in ((src, "Qwen/Qwen3-14B"), (tgt, "Qwen/Qwen3-32B")):
        snapshot, tensors = repos[repo]
        assert path.resolve() == snapshot.resolve(), (how, path)
        if how != "HF_HUB_CACHE":
            continue                                                    # the same files: loaded once
        model = kvt.load_model(path, torch.bfloat16)
        state = {f"model.{k}" if not k.startswith(("model.", "lm_head")) else k: v for k, v in model.state_dict().items()}
        assert set(state) == set(tensors) and all(torch.equal(state[n], t) for n, t in tensors.items())
        assert model.config.n_layers == (2 if repo.endswith("14B") else 3) and model.config.vocab_size == 151936
    if how == "HF_HUB_CACHE":
        assert kvt.load_tokenizer(src).stop_ids == (151645, 151643)     # <|im_end|>, <|endoftext|>


def test_missing_pair_names_every_place_and_the_download(nowhere, monkeypatch):
    """A pair in neither place: one line naming ./weights, the repository's weights/, the installed toy
    family's folder and every cache looked in, with the `hf download` command."""
    monkeypatch.setenv("HF_HUB_CACHE", str(nowhere / "cache"))
    with pytest.raises(KvtError) as e:
        find_weights("qwen3-14b")
    msg = str(e.value)
    assert "\n" not in msg and msg.count("qwen3-14b") >= 3, msg
    for place in ("weights/qwen3-14b", str(nowhere / "cache" / "models--Qwen--Qwen3-14B"),
                  str(nowhere / "home" / ".cache" / "huggingface" / "hub" / "models--Qwen--Qwen3-14B"),
                  "hf download Qwen/Qwen3-14B"):
        assert place in msg, (place, msg)


def test_run_folders_are_named_after_the_pair_not_the_commit(hub_cache):
    """Bug: --source/--target pointing into the cache named the run folder after the snapshot's commit hash
    (runs/<hash>_<hash>), so the same pair by --pair and by path made two runs."""
    home, repos = hub_cache
    src, tgt = (repos[r][0] for r in ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B"))
    assert resolve(parse_args(["--source", str(src), "--target", str(tgt)]))[2:] == ("qwen3-14b", "qwen3-32b")
    assert checkpoint_name(home / "hub" / "models--Org--Some-Model" / "snapshots" / "abc") == "some-model"
    assert checkpoint_name("weights/toy-s") == "toy-s"
