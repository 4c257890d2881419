"""A model's tokenizer: tokenizer.json on the `tokenizers` library, the special tokens
of tokenizer_config.json, and the chat template rendered with jinja2 as transformers
renders it.

transformers' tokenizer wraps the same `tokenizers` object; loading it through
AutoTokenizer costs a server about 90 MB more for its lifetime (transformers' loading
machinery and Python-side vocabularies). What this engine calls is small and is
implemented here the way transformers 5 does it, and tested against it on the
embedded model and a tiny byte-level one:
- encode: the backend's encode (split_special_tokens: its encode_special_tokens);
- decode: the backend's decode. transformers 5 applies clean_up_tokenization_spaces
  only to non-BPE models, so does this;
- apply_chat_template: a sandboxed jinja2 environment with trim_blocks and
  lstrip_blocks, the loop controls, a `{% generation %}` block that renders its body,
  the tojson filter without HTML escaping, raise_exception and strftime_now; the
  template sees messages, tools, documents, add_generation_prompt and the special
  tokens by name (bos_token, eos_token, ...).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken
    dict with its text under "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(hf_dir: Path, config: dict) -> Optional[str]:
    """The template transformers would use with no tools: chat_template.jinja when the
    directory has one, else tokenizer_config.json's (a list of named templates: the
    one named "default")."""
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        if "default" not in named:
            raise ValueError(f"the tokenizer has chat templates {sorted(named)} and none named 'default'")
        template = named["default"]
    return template


def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses
        it to mark assistant tokens for training masks)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`. Not safe
    for concurrent encodes with split_special_tokens (a flag on the shared backend):
    gateeng.model.chat serializes them."""

    def __init__(self, backend, special: dict, chat_template: Optional[str], clean_up_spaces: bool = False):
        self.backend = backend
        self.special = {k: v for k, v in special.items() if v is not None}
        self.chat_template = chat_template
        self._clean_up = clean_up_spaces and type(backend.model).__name__ != "BPE"
        self._compiled = None
        eos = self.special.get("eos_token")
        self.eos_token_id = backend.token_to_id(eos) if eos is not None else None

    @classmethod
    def from_dir(cls, hf_dir) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend
        hf_dir = Path(hf_dir)
        path = hf_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {hf_dir}: gateeng reads fast (tokenizers) tokenizers only")
        config_path = hf_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        return cls(Backend.from_file(str(path)), special, _chat_template(hf_dir, config),
                   bool(config.get("clean_up_tokenization_spaces", False)))

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list:
        self.backend.encode_special_tokens = split_special_tokens
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self.backend.encode_special_tokens = False

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False):
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        text = self._compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special)
        return self.encode(text) if tokenize else text


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
