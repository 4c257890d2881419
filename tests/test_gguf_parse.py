"""A conversion's child process parses each GGUF's header once, for every reader in it
(gguf_weights.read_each_file_once)."""
import os

import gguf

from gateeng.model.gguf_weights import read_each_file_once, read_table


def test_a_conversion_child_parses_each_file_once_for_itself_and_transformers(tiny_gguf, monkeypatch):
    from transformers import AutoConfig
    parsed = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(path)
            super().__init__(path, *args, **kwargs)

    # monkeypatch puts both of gguf's names back after the test, whatever it set.
    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setattr(gguf, "get_tensor_name_map", gguf.get_tensor_name_map)
    path = tiny_gguf("Q8_0", byte_vocab=True)["path"]
    read_table(path)
    assert len(parsed) == 1   # before: a parse per read
    read_each_file_once()
    first = read_table(path)
    monkeypatch.chdir(path.parent)
    again = read_table(path.name)   # the same file by another spelling of its path
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert len(parsed) == 2 and os.path.realpath(parsed[1]) == os.path.realpath(path)
    assert first == again and config.num_hidden_layers == first[2]["block_count"]
    other = tiny_gguf("Q4_0", byte_vocab=True)["path"]
    read_table(other)
    assert len(parsed) == 3
    arch = gguf.MODEL_ARCH.LLAMA
    assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
