from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    EOS: _ClassVar[FinishReason]
    ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
EOS: FinishReason
ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Determinism(_message.Message):
    __slots__ = ("mode", "margin_threshold", "max_window", "stream_policy")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[Determinism.Mode]
        MODE_OFF: _ClassVar[Determinism.Mode]
        MODE_VERIFIED: _ClassVar[Determinism.Mode]
    MODE_UNSPECIFIED: Determinism.Mode
    MODE_OFF: Determinism.Mode
    MODE_VERIFIED: Determinism.Mode
    class StreamPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VERIFIED_ONLY: _ClassVar[Determinism.StreamPolicy]
        EAGER: _ClassVar[Determinism.StreamPolicy]
    VERIFIED_ONLY: Determinism.StreamPolicy
    EAGER: Determinism.StreamPolicy
    MODE_FIELD_NUMBER: _ClassVar[int]
    MARGIN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STREAM_POLICY_FIELD_NUMBER: _ClassVar[int]
    mode: Determinism.Mode
    margin_threshold: float
    max_window: int
    stream_policy: Determinism.StreamPolicy
    def __init__(self, mode: _Optional[_Union[Determinism.Mode, str]] = ..., margin_threshold: _Optional[float] = ..., max_window: _Optional[int] = ..., stream_policy: _Optional[_Union[Determinism.StreamPolicy, str]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "messages", "chat", "sampling", "determinism")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    messages: Messages
    chat: bool
    sampling: SamplingParams
    determinism: Determinism
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., chat: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., determinism: _Optional[_Union[Determinism, _Mapping]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("token_ids", "text", "position", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    position: int
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., position: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class Rollback(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class DeterminismReport(_message.Message):
    __slots__ = ("mode", "decode_steps", "triggers_margin", "triggers_window", "triggers_finish", "verify_passes", "replayed_tokens", "mismatches", "rolled_back_tokens", "retractions", "margin_threshold", "mismatches_margin", "mismatches_window", "mismatches_finish", "direct_steps", "mismatches_direct", "triggers_router", "mismatches_router")
    MODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRIGGERS_MARGIN_FIELD_NUMBER: _ClassVar[int]
    TRIGGERS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TRIGGERS_FINISH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PASSES_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    MARGIN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_MARGIN_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FINISH_FIELD_NUMBER: _ClassVar[int]
    DIRECT_STEPS_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_DIRECT_FIELD_NUMBER: _ClassVar[int]
    TRIGGERS_ROUTER_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_ROUTER_FIELD_NUMBER: _ClassVar[int]
    mode: str
    decode_steps: int
    triggers_margin: int
    triggers_window: int
    triggers_finish: int
    verify_passes: int
    replayed_tokens: int
    mismatches: int
    rolled_back_tokens: int
    retractions: int
    margin_threshold: float
    mismatches_margin: int
    mismatches_window: int
    mismatches_finish: int
    direct_steps: int
    mismatches_direct: int
    triggers_router: int
    mismatches_router: int
    def __init__(self, mode: _Optional[str] = ..., decode_steps: _Optional[int] = ..., triggers_margin: _Optional[int] = ..., triggers_window: _Optional[int] = ..., triggers_finish: _Optional[int] = ..., verify_passes: _Optional[int] = ..., replayed_tokens: _Optional[int] = ..., mismatches: _Optional[int] = ..., rolled_back_tokens: _Optional[int] = ..., retractions: _Optional[int] = ..., margin_threshold: _Optional[float] = ..., mismatches_margin: _Optional[int] = ..., mismatches_window: _Optional[int] = ..., mismatches_finish: _Optional[int] = ..., direct_steps: _Optional[int] = ..., mismatches_direct: _Optional[int] = ..., triggers_router: _Optional[int] = ..., mismatches_router: _Optional[int] = ...) -> None: ...

class Reproducibility(_message.Message):
    __slots__ = ("engine_version", "model_fingerprint", "dtype", "device_kind", "kernel_plan", "self_check_passed", "self_check", "seed", "seeded", "device_name", "isa", "torch_version", "triton_version", "cuda_version", "num_threads", "fingerprint", "reference", "tensor_parallel_size", "weight_version", "replica")
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    KERNEL_PLAN_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_PASSED_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    ISA_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRITON_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    engine_version: str
    model_fingerprint: str
    dtype: str
    device_kind: str
    kernel_plan: str
    self_check_passed: bool
    self_check: str
    seed: int
    seeded: bool
    device_name: str
    isa: str
    torch_version: str
    triton_version: str
    cuda_version: str
    num_threads: int
    fingerprint: str
    reference: str
    tensor_parallel_size: int
    weight_version: int
    replica: str
    def __init__(self, engine_version: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., device_kind: _Optional[str] = ..., kernel_plan: _Optional[str] = ..., self_check_passed: _Optional[bool] = ..., self_check: _Optional[str] = ..., seed: _Optional[int] = ..., seeded: _Optional[bool] = ..., device_name: _Optional[str] = ..., isa: _Optional[str] = ..., torch_version: _Optional[str] = ..., triton_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., num_threads: _Optional[int] = ..., fingerprint: _Optional[str] = ..., reference: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., weight_version: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "determinism", "reproducibility", "logprobs", "prompt_logprobs", "prompt_token_ids", "sampling", "finish_detail")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    REPRODUCIBILITY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FINISH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    determinism: DeterminismReport
    reproducibility: Reproducibility
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    finish_detail: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., determinism: _Optional[_Union[DeterminismReport, _Mapping]] = ..., reproducibility: _Optional[_Union[Reproducibility, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., finish_detail: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "rollback", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    rollback: Rollback
    complete: CompleteResponse
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., rollback: _Optional[_Union[Rollback, _Mapping]] = ..., complete: _Optional[_Union[CompleteResponse, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("source", "fingerprint", "dtype", "vocab_size", "max_model_len", "num_layers", "hidden_size", "eos_token_ids", "architecture", "has_chat_template", "name", "weight_version", "trainable", "untrainable_reason")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    UNTRAINABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    source: str
    fingerprint: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    hidden_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    architecture: str
    has_chat_template: bool
    name: str
    weight_version: int
    trainable: bool
    untrainable_reason: str
    def __init__(self, source: _Optional[str] = ..., fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., architecture: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., name: _Optional[str] = ..., weight_version: _Optional[int] = ..., trainable: _Optional[bool] = ..., untrainable_reason: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GateConfig(_message.Message):
    __slots__ = ("margin_threshold", "max_window")
    MARGIN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    margin_threshold: float
    max_window: int
    def __init__(self, margin_threshold: _Optional[float] = ..., max_window: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("engine_version", "device_kind", "kernel_plan", "self_check_passed", "self_check", "gate", "requests_running", "requests_waiting", "kv_cache_usage", "max_queue", "reproducibility")
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    KERNEL_PLAN_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_PASSED_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    REPRODUCIBILITY_FIELD_NUMBER: _ClassVar[int]
    engine_version: str
    device_kind: str
    kernel_plan: str
    self_check_passed: bool
    self_check: str
    gate: GateConfig
    requests_running: int
    requests_waiting: int
    kv_cache_usage: float
    max_queue: int
    reproducibility: Reproducibility
    def __init__(self, engine_version: _Optional[str] = ..., device_kind: _Optional[str] = ..., kernel_plan: _Optional[str] = ..., self_check_passed: _Optional[bool] = ..., self_check: _Optional[str] = ..., gate: _Optional[_Union[GateConfig, _Mapping]] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., max_queue: _Optional[int] = ..., reproducibility: _Optional[_Union[Reproducibility, _Mapping]] = ...) -> None: ...

class UpdateGateConfigRequest(_message.Message):
    __slots__ = ("margin_threshold", "max_window")
    MARGIN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    margin_threshold: float
    max_window: int
    def __init__(self, margin_threshold: _Optional[float] = ..., max_window: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("model_fingerprint", "weight_version", "seconds", "requests_ended")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ENDED_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    weight_version: int
    seconds: float
    requests_ended: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., weight_version: _Optional[int] = ..., seconds: _Optional[float] = ..., requests_ended: _Optional[int] = ...) -> None: ...
