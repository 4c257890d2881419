"""OLMoE from GGUF files as llama.cpp's converter writes them (conversion/olmo.py
OlmoeModel: architecture olmoe, q and k not permuted, q/k norms over the whole
projection, a GPT-2-style BPE in tokenizer.ggml.*), on a tiny random model with a
trained byte-level BPE: a bf16 file is its Hugging Face directory's model (config,
weights, tokenizer, VERIFIED answers) and transformers' float32 logits; Q8_0 and Q4_0
experts are served as stored, other types dequantized and named; a broken file is
refused by the tensor's or the key's name.

The files are written with the `gguf` package as the converter lays them out
(tests/tiny_gguf.py; the tokenizer keys as its get_vocab_base and gguf.SpecialVocab
write them). Checked once by hand against llama.cpp 11434: convert_hf_to_gguf.py
--outtype bf16 on this module's model directory (its pre-tokenizer named "olmo", as
OLMoE's is) writes the same tensor names, shapes, types and bytes and the same metadata
and tokenizer values but general.name and size_label; it lacks olmoe.vocab_size and
olmoe.rope.dimension_count, which tiny_gguf writes for every architecture and the
reader checks agree. gateeng serves the converter's bf16 and f32 files as the model
of the directory, and llama-quantize's Q4_0 and Q8_0 of them as stored; llama-server
(one slot, greedy) on the bf16 and Q8_0 files gives gateeng's VERIFIED tokens, 12 of 12
(on Q4_0 the first 5, then the two arithmetics part on near-equal logits)."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model import families, loader
from gateeng.model.gguf_weights import GGUFTensors, read_table
from gateeng.model.llama import LlamaModel
from gateeng.model.loader import LoadedModel
from gateeng.model.tokenizer import Tokenizer
from gateeng.plans import packing
from gateeng.plans.generic import FastPlan
from test_model import prefill_logits
from test_model_families import SEQS, TINY
from test_moe_gguf import answers, load_into
from tiny import hf_family
from tiny_gguf import moe_tensors, write_file, write_tiny_moe_gguf

# The experts of layer 0's down projection in Q4_0, layer 1's in Q5_0 (not served as
# stored: dequantized), every gate and up in Q8_0; the rest bf16.
QUANT = {"blk.0.ffn_down_exps.weight": "Q4_0", "blk.1.ffn_down_exps.weight": "Q5_0", "*_exps.weight": "Q8_0",
         "*": "BF16"}
TEXTS = ["the quick brown fox jumps over the lazy dog", "Hello world, hello there!\n\n  Les élèves étudient.",
         "def f(x):\n\treturn x + 1<|endoftext|>", "<|padding|> 12345 🦙 ---===", ""]


def trained_tokenizer(path) -> None:
    """A byte-level BPE of 300 tokens trained on a few lines, with GPT-NeoX's specials
    (OLMoE's: <|endoftext|> 0, bos and eos; <|padding|> 1) and a chat template, saved
    as a Hugging Face tokenizer in `path`."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 3,
                             "Hello world, hello there! The weather is nice.", "Les élèves étudient à l'école.",
                             "def f(x):\n    return x + 1\n"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|padding|>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast.save_pretrained(path)


def converter_tokenizer_kv(hf_dir) -> tuple:
    """The tokenizer.* keys llama.cpp's converter writes for a GPT-2-style BPE
    (TextModel._set_vocab_gpt2: each id's token, CONTROL for a special added token, else
    NORMAL; then gguf.SpecialVocab's merges, special ids and chat template), in
    tiny_gguf.write_file's form."""
    from gguf import GGUFValueType as T, Keys, SpecialVocab, TokenType
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    types = [int(TokenType.CONTROL if i in added and added[i].special else TokenType.NORMAL) for i in range(len(by_id))]
    special = SpecialVocab(hf_dir, load_merges=True)
    ids = {"bos": Keys.Tokenizer.BOS_ID, "eos": Keys.Tokenizer.EOS_ID, "pad": Keys.Tokenizer.PAD_ID}
    return ((Keys.Tokenizer.MODEL, "gpt2", T.STRING, None), (Keys.Tokenizer.PRE, "olmo", T.STRING, None),
            (Keys.Tokenizer.LIST, [by_id[i] for i in range(len(by_id))], T.ARRAY, T.STRING),
            (Keys.Tokenizer.TOKEN_TYPE, types, T.ARRAY, T.INT32),
            (Keys.Tokenizer.MERGES, special.merges, T.ARRAY, T.STRING),
            *((ids[kind], i, T.UINT32, None) for kind, i in special.special_token_ids.items()),
            (Keys.Tokenizer.CHAT_TEMPLATE, special.chat_template, T.STRING, None))


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    """The Hugging Face directory of a tiny OLMoE on bf16-rounded weights (so its float32
    model is the numbers every file holds), as OLMoE-1B-7B is shaped: as many kv heads as
    heads, rms_norm_eps 1e-5 (what the converter writes for OLMoE whatever the config
    says), every layer routing; and its bf16 and quantized GGUFs."""
    where = tmp_path_factory.mktemp("olmoe_gguf")
    hf = hf_family("olmoe", vocab_size=300, bos_token_id=0, eos_token_id=0, pad_token_id=1, rms_norm_eps=1e-5,
                   num_key_value_heads=4)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf_dir = where / "hf"
    hf.save_pretrained(hf_dir, safe_serialization=True)
    trained_tokenizer(hf_dir)
    kv = converter_tokenizer_kv(hf_dir)
    files = {name: write_tiny_moe_gguf(where / f"olmoe-{name}.gguf", hf, qtype, kv)["path"]
             for name, qtype in (("bf16", "BF16"), ("quant", QUANT))}
    return dict(hf=hf, dir=hf_dir, kv=kv, **files)


@pytest.fixture(scope="module")
def bf16(olmoe):
    """The bf16 file served."""
    return loader.load(str(olmoe["bf16"]))


def test_a_bf16_olmoe_gguf_is_its_hf_directorys_model(olmoe, bf16):
    got = bf16
    want = loader.load(str(olmoe["dir"]))
    cfg = got.config
    assert cfg == want.config
    assert (cfg.architecture, cfg.qk_norm, cfg.qk_norm_scope, cfg.num_kv_heads) == ("olmoe", True, "projection", 4)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (4, 2, 32)
    assert (cfg.moe.routing, cfg.moe.norm_topk_prob, cfg.moe.sparse_layers) == ("softmax_topk", False, (0, 1))
    assert not cfg.tie_word_embeddings and cfg.vocab_size == 300 and cfg.eos_token_ids == (0,)
    for (n, a), (_, b) in zip(got.model.named_parameters(), want.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    ours, theirs = answers(got), answers(want)
    assert ours == theirs and len(set(map(tuple, ours))) == 1


def test_a_bf16_olmoe_gguf_matches_transformers_in_float32(olmoe, bf16):
    """The weights read from the file, in a float32 model, give transformers' float32
    logits on the same weights within the dense families' bound (1e-3)."""
    got = bf16
    model = LlamaModel(got.config, torch.float32)
    model.load_hf_state_dict({k: v.float() for k, v in got.model.hf_state_dict().items()})
    ours = prefill_logits(LoadedModel(model, got.tokenizer, got.config, "f32", "f32"), FastPlan(), SEQS, chunk=7)
    for s, lg in zip(SEQS, ours):
        with torch.no_grad():
            want = olmoe["hf"](torch.tensor([s])).logits[0].float()
        assert (lg - want).abs().max().item() < 1e-3


def test_an_olmoe_ggufs_tokenizer_is_its_hf_directorys(olmoe, bf16):
    from transformers import AutoTokenizer

    got = bf16.tokenizer
    mine, theirs = Tokenizer.from_dir(olmoe["dir"]), AutoTokenizer.from_pretrained(olmoe["dir"])
    assert len(theirs) == 300 and got.eos_token_id == mine.eos_token_id == 0
    for text in TEXTS:
        ids = got.encode(text)
        assert ids == mine.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert got.decode(ids) == mine.decode(ids) == theirs.decode(ids) == text
        assert got.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert any(len(t) > 1 for t in got.backend.encode(TEXTS[0]).tokens)   # the merges apply
    chat = [{"role": "user", "content": "hello there"}]
    assert got.apply_chat_template(chat, tokenize=True) == theirs.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_quantized_olmoe_experts_are_served_as_stored_and_others_named(olmoe, capsys):
    loaded = loader.load(str(olmoe["quant"]))
    err = capsys.readouterr().err
    assert packing.of(loaded.model).stored_types == {"Q4_0": 1, "Q8_0": 4}
    assert "served as stored" in err and "dequantized to bf16 (not served as stored): 1 Q5_0" in err, err
    held = packing.of(loaded.model).shared
    for i, layer in enumerate(loaded.model.layers):
        for expert in layer.experts:
            assert id(expert.gate_up) in held and expert.gate_up.untyped_storage().nbytes() == 0
            assert (id(expert.down) in held) == (i == 0)
    want, alone, batch = answers(loaded)
    assert alone == want and batch == want
    # Dequantized to bf16 it is another model, named so.
    deq = loader.load(str(olmoe["quant"]), dequantize=True)
    assert not packing.quantized(deq.model) and deq.fingerprint != loaded.fingerprint
    assert "dequantized to bf16 (not served as stored)" in capsys.readouterr().err


def test_a_broken_olmoe_gguf_is_refused_by_name(olmoe, tmp_path):
    hf, arch = olmoe["hf"], "olmoe"
    tensors = dict(moe_tensors(hf, arch))
    del tensors["blk.1.ffn_down_exps.weight"]
    path = tmp_path / "no-expert.gguf"

    def experts(writer):
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)

    write_file(path, arch, "broken", hf, [(g, w, "F32") for g, w in tensors.items()], {"*": "F32"}, experts,
               olmoe["kv"])
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_down_exps\.weight is missing"):
        load_into({"olmoe": {"path": olmoe["bf16"]}}, GGUFTensors(path), "olmoe")

    # The metadata as the file has it, each field broken in turn.
    _, table, meta = read_table(olmoe["bf16"])
    shapes = {t.name: t.shape for t in table.values()}
    ids = {"bos_token_id": 0, "eos_token_id": 0, "padding_token_id": 1}
    olmoe_family = families.FAMILIES["olmoe"]
    config = olmoe_family.gguf_decoder_config(meta, shapes, ids)
    assert config["norm_topk_prob"] is False and config["pad_token_id"] == 1 and not config["tie_word_embeddings"]
    for change, message in (
            (dict(expert_gating_func=2), r"olmoe\.expert_gating_func=2 is not supported"),
            ({"rope.dimension_count": 8}, r"olmoe\.rope\.dimension_count=8 is not served \(only 16"),
            ({"vocab_size": 301}, r"olmoe\.vocab_size=301 is not served \(only 300: the embedding has"),
            ({"attention.clamp_kqv": 8.0}, r"metadata olmoe\.attention\.clamp_kqv is not supported"),
            ({"rope.scaling.type": "yarn"}, r"olmoe\.rope\.scaling\.type='yarn' is not served"),
            ({"attention.head_count_kv": [4, 2]}, r"olmoe\.attention\.head_count_kv is an array")):
        with pytest.raises(ValueError, match=message):
            olmoe_family.gguf_decoder_config(dict(meta, **change), shapes, ids)
    for key in ("attention.head_count", "expert_used_count"):
        with pytest.raises(ValueError, match=rf"GGUF metadata olmoe\.{key} is missing"):
            olmoe_family.gguf_decoder_config({k: v for k, v in meta.items() if k != key}, shapes, ids)
    with pytest.raises(ValueError, match=r"tensor token_embd\.weight is missing"):
        olmoe_family.gguf_decoder_config(meta, {k: v for k, v in shapes.items() if k != "token_embd.weight"}, ids)
