"""GetModelInfo names the model without telling clients where it lives on the
server: its name and fingerprint, and its path only with --expose-model-path."""
import dataclasses

import grpc
import pytest

from gateeng.config import ServerConfig
from gateeng.serving.gateway import model_name
from gateeng.tools import cli
from gateeng.v1 import engine_pb2 as pb
from tests.test_server_async import Running, tiny_config
from tests.tiny import tiny_loaded

PATH = "/srv/private-models/team-a/tiny-llama"


@pytest.mark.parametrize("source,name", [
    ("/models/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ("/models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct"),
    ("/models/smollm2-135m.Q8_0.gguf", "smollm2-135m.Q8_0"),
    ("relative/dir", "dir"),
])
def test_model_name_is_the_gguf_stem_or_the_directory_name(source, name):
    assert model_name(source) == name


def model_info(settings: ServerConfig) -> tuple:
    loaded = dataclasses.replace(tiny_loaded("float32"), source=PATH)
    srv = Running(tiny_config(), loaded=loaded, settings=settings)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            raw = ch.unary_unary("/gateeng.v1.Engine/GetModelInfo")(pb.GetModelInfoRequest().SerializeToString(),
                                                                     timeout=10)
        return pb.ModelInfo.FromString(raw), raw, loaded.fingerprint
    finally:
        srv.stop()


def test_model_info_gives_the_name_and_fingerprint_but_not_the_path_by_default():
    info, raw, fingerprint = model_info(ServerConfig(port=0, metrics_port=None, http_port=None))
    assert info.name == "tiny-llama" and info.fingerprint == fingerprint
    assert info.source == ""
    assert b"private-models" not in raw and b"/srv" not in raw


def test_expose_model_path_shows_the_path_and_served_model_name_renames():
    info, _, fingerprint = model_info(ServerConfig(port=0, metrics_port=None, http_port=None, expose_model_path=True,
                                                   served_model_name="house-model"))
    assert (info.source, info.name, info.fingerprint) == (PATH, "house-model", fingerprint)


def test_serve_flag_expose_model_path_is_off_by_default():
    serve = cli.build_parser()
    assert not cli.server_config(serve.parse_args(["serve"])).expose_model_path
    assert cli.server_config(serve.parse_args(["serve", "--expose-model-path"])).expose_model_path
