"""A model directory's config.json, read without transformers where that is exact.

transformers' config classes fill a field that config.json leaves out with their
class default, and the defaults differ by family (a family's `required` fields in
gateeng.model.families: a num_key_value_heads of 32, a sliding_window of 4096, a
head_dim of 128). A file that names every field
the engine reads (ModelConfig.from_hf) is read as JSON; one that leaves any of them
to a class default is read through transformers' AutoConfig, so the engine never
guesses a default. The difference is memory: AutoConfig imports transformers' model
loading machinery (torch.distributed.tensor, sympy, accelerate), about 50 MB that a
server would hold for its lifetime. A converted GGUF's config names every field.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from gateeng.logs import log
from gateeng.model.families import FAMILIES

# Read by ModelConfig.from_hf with no default of its own. attention_bias and mlp_bias
# may be absent: every supported family's class default is False, as from_hf reads
# an absent one.
REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
            "tie_word_embeddings", "bos_token_id", "eos_token_id")


def defaulted_fields(raw: dict) -> list:
    """The fields from_hf reads that `raw` (a parsed config.json) leaves to a
    transformers class default; [] when it names them all."""
    # and the fields a family's class defaults to something other than what from_hf
    # assumes when they are absent (None: head_dim = hidden / heads, no sliding window)
    family = FAMILIES.get(raw.get("model_type"))
    spellings = tuple((f,) for f in REQUIRED) + (family.required_fields() if family else ())
    missing = [names[0] for names in spellings if not any(n in raw for n in names)]
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "rope_theta" not in raw and "rope_theta" not in rope:
        missing.append("rope_theta")
    return missing


def read_config(hf_dir: Path):
    """The model's config as attributes, as ModelConfig.from_hf reads it."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    raw = json.loads(path.read_text())
    missing = defaulted_fields(raw)
    if not missing:
        return SimpleNamespace(**raw)
    log(f"config.json leaves {', '.join(missing)} to transformers' class defaults: reading it "
        f"through transformers")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(hf_dir)
