"""A model called from another thread than the one that loaded it says so, once."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from nxdplug import NeuronConfig, from_pretrained

SETTINGS = {"batch_size": 1, "seq_len": 16, "max_context_length": 8, "torch_dtype": "float32"}
IDS = torch.tensor([[1, 2, 3]])


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


def loaded(checkpoint):
    app = from_pretrained(checkpoint, NeuronConfig(**SETTINGS))
    app.to_cpu()
    return app


def calls_on_a_thread(app, name: str) -> list[str]:
    """Two forward calls on a new thread ``name``; the RuntimeWarnings they gave."""
    caught: list[warnings.WarningMessage] = []

    def call() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            app(input_ids=IDS)
            app(input_ids=IDS)
        caught.extend(seen)

    thread = threading.Thread(target=call, name=name)
    thread.start()
    thread.join()
    return [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_another_thread_than_the_loading_one_warns_once(checkpoint) -> None:
    app = loaded(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        app(input_ids=IDS)
    (message,) = calls_on_a_thread(app, "worker")
    assert "runs on thread 'worker' but was loaded on 'MainThread'" in message
    assert "up to 2x slower" in message


def test_a_model_loaded_on_a_thread_that_ended_does_not_warn(checkpoint) -> None:
    built = []
    loader = threading.Thread(target=lambda: built.append(loaded(checkpoint)), name="loader")
    loader.start()
    loader.join()
    assert calls_on_a_thread(built[0], "worker") == []
