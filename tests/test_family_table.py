"""The family table (gateeng/model/families.py) is what every reader of a model's
names reads: a checkpoint's names are the table's, hf_state_dict gives back what
load_hf_state_dict took, weight updates expect exactly a checkpoint's tensors and
shapes, and a tensor-parallel shard takes every weight of each family's block."""
import pytest
import torch

from gateeng.engine.weights import expected_shapes
from gateeng.model import families
from gateeng.model.families import config_from_hf
from gateeng.model.llama import LlamaModel
from tiny import FAMILIES, hf_family


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request):
    return hf_family(request.param)


def test_every_family_has_one_entry_and_one_reader():
    assert families.SUPPORTED == tuple(families.FAMILIES)
    assert all(families.gguf_family(f.gguf, f.moe is not None) is f for f in families.FAMILIES.values() if f.gguf)
    with pytest.raises(ValueError, match="is not a supported Llama-family decoder"):
        families.family("gpt2")


def test_hf_names_round_trip(hf):
    """load_hf_state_dict, then hf_state_dict: the same names and the same bits."""
    cfg = config_from_hf(hf.config)
    want = hf.state_dict()
    model = LlamaModel(cfg, torch.float32)
    model.load_hf_state_dict(want)
    got = model.hf_state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    again = LlamaModel(cfg, torch.float32)
    again.load_hf_state_dict(got)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))


def test_weight_updates_expect_a_checkpoints_tensors(hf):
    cfg = config_from_hf(hf.config)
    assert expected_shapes(cfg) == {name: tuple(t.shape) for name, t in hf.state_dict().items()}


def test_every_gguf_name_has_a_part():
    for fam in families.FAMILIES.values():
        block = fam.block
        for w in block.layer + (block.embed, block.norm, block.lm_head):
            assert len(w.hf) == len(w.gguf) == len(w.rows), w.attr
            assert not w.rotary or len(w.rotary) == len(w.rows), w.attr
        # (a mixture of experts' block names gate_up and down twice: a plain MLP's, an expert's)
        assert sorted(block.gguf_order) == sorted({w.attr for w in block.layer})
