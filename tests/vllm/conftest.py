"""Fixtures the real-engine test modules share: the log directory, the
model (made locally, nothing downloaded), and the results report the Rust
runner reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

import make_model

#: Per-case results, written to ``APD_VLLM_RESULTS`` at the end of the session.
RESULTS: Dict[str, Any] = {}


@pytest.fixture(scope="session")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = os.environ.get("APD_VLLM_LOG_DIR")
    if d:
        p = Path(d)
        p.mkdir(parents=True, exist_ok=True)
        return p
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model.make(tmp_path_factory.mktemp("model") / "tiny-gqa-llama")


@pytest.fixture(scope="session", autouse=True)
def report(logdir: Path) -> Iterator[None]:
    yield
    path = Path(os.environ.get("APD_VLLM_RESULTS", logdir / "results.json"))
    path.write_text(json.dumps(RESULTS, indent=2))
    print(f"\nvLLM e2e results: {path}\n{json.dumps(RESULTS, indent=2)}")
