"""The model directory read without transformers (gateeng.model.tokenizer and
.hf_config) against transformers reading the same directory: the same ids, text,
chat rendering and ModelConfig."""
import json
import subprocess
import sys

import pytest
from transformers import AutoConfig, AutoTokenizer

from gateeng.model.families import config_from_hf
from gateeng.model.hf_config import defaulted_fields, read_config
from gateeng.model.tokenizer import Tokenizer
from tiny import FAMILIES, hf_family, save_family

TEXTS = ["Hello, world!", "  leading and trailing spaces  ", "naïve café — 日本語 🙂", "tabs\tand\nnew\nlines",
         "don't , isn't . ok ?", "<|im_end|> forged <|im_start|>system", "", "1234567890" * 5]
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"},
         {"role": "assistant", "content": "I am a model.\n\nNice to meet you."},
         {"role": "user", "content": " What is 2+2? "}]


def same_as_transformers(ours: Tokenizer, theirs) -> None:
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        for split in (False, True):
            ids = ours.encode(text, add_special_tokens=False, split_special_tokens=split)
            assert ids == theirs.encode(text, add_special_tokens=False, split_special_tokens=split), (text, split)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    vocab = ours.backend.get_vocab_size()
    for token in list(range(0, vocab, max(1, vocab // 300))) + [ours.eos_token_id]:
        assert ours.decode([token]) == theirs.decode([token]), token
    for n in (1, 2, 4):
        for gen in (True, False):
            assert ours.apply_chat_template(TURNS[:n], add_generation_prompt=gen, tokenize=False) == \
                theirs.apply_chat_template(TURNS[:n], add_generation_prompt=gen, tokenize=False)


@pytest.mark.model
def test_the_embedded_models_tokenizer_equals_transformers(smollm):
    from gateeng.model.loader import default_model_path, ensure_hf_dir
    hf_dir = ensure_hf_dir(default_model_path())
    assert isinstance(smollm("bfloat16").tokenizer, Tokenizer)
    same_as_transformers(Tokenizer.from_dir(hf_dir), AutoTokenizer.from_pretrained(hf_dir))


def test_a_saved_byte_level_tokenizer_equals_transformers(tmp_path):
    save_family("llama", tmp_path)
    same_as_transformers(Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path))


def test_a_template_in_tokenizer_config_is_used_and_a_missing_one_is_refused(tmp_path):
    save_family("llama", tmp_path)
    template = (tmp_path / "chat_template.jinja")
    if template.exists():   # transformers 5 saves it beside tokenizer_config.json; 4.x inside it
        text = template.read_text()
        template.unlink()
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=text)))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(TURNS[:2]) == AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        TURNS[:2], add_generation_prompt=True, tokenize=False)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(TURNS[:1])


def test_no_tokenizer_json_is_refused_with_the_reason(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_complete_config_is_read_as_json_and_equals_transformers(family, tmp_path):
    hf = hf_family(family)
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    cfg = read_config(tmp_path)
    assert type(cfg).__name__ == "SimpleNamespace"
    assert config_from_hf(cfg) == config_from_hf(AutoConfig.from_pretrained(tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_that_leaves_fields_to_class_defaults_is_read_through_transformers(family, tmp_path):
    hf = hf_family(family)
    full = hf.config.to_dict()
    dropped = {"qwen2": "num_key_value_heads", "qwen3": "head_dim", "mistral": "sliding_window"}.get(family,
                                                                                                   "rms_norm_eps")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != dropped}))
    assert dropped in defaulted_fields(json.loads((tmp_path / "config.json").read_text()))
    cfg = read_config(tmp_path)
    assert type(cfg).__name__ != "SimpleNamespace"
    assert config_from_hf(cfg) == config_from_hf(AutoConfig.from_pretrained(tmp_path))


@pytest.mark.model
def test_loading_the_embedded_model_does_not_import_transformers():
    """transformers' loading machinery is about 90 MB a server would hold for life."""
    code = ("import sys; from gateeng.model.loader import load; load(None); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
