"""The 0/1 environment switches of the CPU bf16 speed-ups (ops/switches.py): where each applies, and a
bad value failing when the trainer is built (docs/errors.md C126, C127)."""

from __future__ import annotations

import helpers
import pytest
from conftest import build_tiny_model, build_tiny_tokenizer

from posttrain.ops import float32_attention, weight_casts

SWITCHES = [
    pytest.param(weight_casts, "set it to 0 to let autocast cast every use, or unset it", id="weight_casts"),
    pytest.param(
        float32_attention,
        "set it to 0 to let autocast run every attention in bf16, or unset it",
        id="float32_attention",
    ),
]


@pytest.mark.parametrize(("module", "fix"), SWITCHES)
def test_the_switch_and_where_it_applies(tmp_path, monkeypatch, module, fix):
    args = helpers.make_config(tmp_path, bf16=True)
    assert module.applies(args)
    assert not module.applies(helpers.make_config(tmp_path, bf16=False))
    monkeypatch.setenv(module.ENV, "0")
    assert not module.applies(args)
    monkeypatch.setenv(module.ENV, "yes")
    for bf16 in (True, False):  # a typo fails whatever the precision
        with pytest.raises(ValueError, match=f"{module.ENV}='yes' is not 0 or 1; {fix}"):
            module.applies(helpers.make_config(tmp_path, bf16=bf16))


def _reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.parametrize(("module", "fix"), SWITCHES)
def test_a_bad_switch_fails_when_the_trainer_is_built(tmp_path, monkeypatch, module, fix):
    tok = build_tiny_tokenizer()
    monkeypatch.setenv(module.ENV, "on")
    with pytest.raises(ValueError, match=fix):
        helpers.make_trainer(tok, _reward, helpers.make_config(tmp_path), model=build_tiny_model(tok))
