"""ServeConfig: precedence (flags > environment > YAML > defaults), parsing, validation, CLI errors."""
from __future__ import annotations

import dataclasses
import inspect
import socket

import pytest
from typer.testing import CliRunner

from tiered_kv.cli import app
from tiered_kv.config import GiB
from tiered_kv.serve_config import SETTINGS, ServeConfig
from tiered_kv.serve_option import human_readable_int


def test_defaults_persist_kv_out_of_the_box():
    c = ServeConfig.load(environ={})
    assert (c.model, c.port, c.model_name, c.api_key) == ("tiny", 8000, "tiny", ())
    tiers = c.tier_config()
    assert tiers.kv_cache_dir == "./kv_cache" and tiers.cpu_bytes == GiB and tiers.disk_bytes == 8 * GiB
    assert c.max_inflight == c.max_num_seqs + c.max_queue_len
    assert c.max_request_body_bytes == 8 << 20
    assert ServeConfig.load(environ={"TIERED_KV_MAX_REQUEST_BODY_MIB": "0.5"}).max_request_body_bytes == 1 << 19


def test_flags_beat_environment_beat_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 7000\nmax-model-len: 512\nserved_model_name: from-yaml\nkv_offloading_size: 0.5\n")
    env = {"TIERED_KV_PORT": "7100", "TIERED_KV_MAX_MODEL_LEN": "1024"}
    c = ServeConfig.load({"port": 7200, "seed": None}, config_file=path, environ=env)
    assert c.port == 7200  # flag
    assert c.max_model_len == 1024  # environment over YAML
    assert c.served_model_name == ("from-yaml",) and c.model_name == "from-yaml"
    assert c.kv_offloading_size == 0.5 and c.tier_config().cpu_bytes == GiB // 2
    assert c.seed == 0  # a flag left as None is not given


def test_environment_values_are_typed():
    env = {
        "TIERED_KV_ENABLE_PREFIX_CACHING": "false",
        "TIERED_KV_NUM_GPU_BLOCKS_OVERRIDE": "128",
        "TIERED_KV_GPU_MEMORY_UTILIZATION": "0.5",
        "TIERED_KV_API_KEY": "k",
        "TIERED_KV_MAX_NUM_BATCHED_TOKENS": "none",
    }
    c = ServeConfig.load(environ=env)
    assert c.enable_prefix_caching is False and c.num_gpu_blocks_override == 128
    assert c.gpu_memory_utilization == 0.5 and c.api_key == ("k",) and c.max_num_batched_tokens is None
    with pytest.raises(ValueError, match="TIERED_KV_PORT"):
        ServeConfig.load(environ={"TIERED_KV_PORT": "eighty"})
    with pytest.raises(ValueError, match="TIERED_KV_ENABLE_PREFIX_CACHING"):
        ServeConfig.load(environ={"TIERED_KV_ENABLE_PREFIX_CACHING": "maybe"})


def test_config_file_from_environment_and_its_errors(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("kv-codec: zstd\n")
    assert ServeConfig.load(environ={"TIERED_KV_CONFIG": str(good)}).kv_codec == "zstd"
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("colour: blue\n")
    with pytest.raises(ValueError, match="unknown key 'colour'"):
        ServeConfig.load(config_file=unknown, environ={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("port: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        ServeConfig.load(config_file=broken, environ={})
    with pytest.raises(ValueError, match="expected a mapping"):
        (tmp_path / "list.yaml").write_text("- 1\n")
        ServeConfig.load(config_file=tmp_path / "list.yaml", environ={})
    with pytest.raises(ValueError, match="missing.yaml"):
        ServeConfig.load(config_file=tmp_path / "missing.yaml", environ={})


LAUGHS = "[&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]" + "".join(  # 9**7 strings through aliases
    f", &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 7)
) + "]"


@pytest.mark.parametrize(
    ("text", "message"),
    [  # each was a traceback (TypeError, RecursionError, OverflowError), a message of several
        # lines or of millions of characters, or one that did not name the file or the flag
        ("model: []\n", "--config {path}: model: expected text, a number or a boolean, got a list"),
        (f"allowed-origins: {LAUGHS}\n", "--config {path}: allowed-origins: expected a list of strings"),
        (f"port: {LAUGHS}\n", "--config {path}: port: expected text, a number or a boolean, got a list"),
        ("port: [\n", "--config {path}: not valid YAML: while parsing a flow node expected the node"),
        ("port: " + "[" * 3000 + "]" * 3000 + "\n", "--config {path}: not valid YAML: nested too deeply"),
        ("port: !!int x\n", "--config {path}: not valid YAML: invalid literal for int()"),
        ("port: 1" + "0" * 5000 + "\n", "--config {path}: not valid YAML: Exceeds the limit (4300 digits)"),
        ("kv-offloading-size: 1.0e308\n", "--kv-offloading-size must be a number of GiB >= 0"),
        ("max-request-body-mib: 1.0e308\n", "--max-request-body-mib must be a number of MiB > 0"),
        ("kv_remote_url: redis://c\nkv_remote_timeout: 1" + "0" * 400 + "\n", "--kv-remote-timeout must be"),
        ("kv_codec: null\n", "--kv-codec is not usable: a codec spec is a string"),
        ("override-generation-config: 5\n", "--override-generation-config must be a non-empty string"),
    ],
)
def test_a_hostile_config_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        ServeConfig.load(config_file=path, environ={})
    said = str(info.value)
    assert message.format(path=path) in said and "\n" not in said and len(said) < 1000, said[:1000]


def test_a_config_file_not_in_utf_8_is_one_line_naming_it(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"port: \xff\n")
    with pytest.raises(ValueError, match=f"--config {path}: 'utf-8' codec can't decode byte 0xff"):
        ServeConfig.load(config_file=path, environ={})


@pytest.mark.parametrize(
    ("environ", "message"),
    [  # each was a traceback (OverflowError, RecursionError) or a message naming nothing
        ({"VLLM_CPU_KVCACHE_SPACE": "inf"}, "VLLM_CPU_KVCACHE_SPACE='inf' is not valid (GiB)"),
        ({"VLLM_CPU_KVCACHE_SPACE": "1e308"}, "VLLM_CPU_KVCACHE_SPACE='1e308' is not valid (GiB)"),
        ({"TIERED_KV_MAX_MODEL_LEN": "9" * 400 + ".5k"}, "TIERED_KV_MAX_MODEL_LEN='999"),
        ({"TIERED_KV_KV_DISK_SIZE": "1e308"}, "--kv-disk-size must be a number of GiB >= 0"),
        ({"TIERED_KV_ALLOWED_ORIGINS": "[" * 100_000}, "not a JSON list of strings"),
        ({"TIERED_KV_API_KEY": "[" * 100_000}, "not a JSON list of strings"),
        ({"TIERED_KV_OVERRIDE_GENERATION_CONFIG": "[" * 100_000},
         "--override-generation-config is nested too deeply to read as JSON"),
        ({"TIERED_KV_OVERRIDE_GENERATION_CONFIG": "1" * 5000}, "--override-generation-config is not JSON"),
        ({"TIERED_KV_OVERRIDE_GENERATION_CONFIG": '{"temperature": 1' + "0" * 400 + "}"},
         "--override-generation-config: temperature must be a number"),
        ({"TIERED_KV_KV_EVENTS_CONFIG": '{"a": ' * 50_000}, "--kv-events-config: kv_events_config is nested too deeply"),
        ({"TIERED_KV_SPECULATIVE_CONFIG": "[" * 100_000}, "--speculative-config: speculative_config is nested too deeply"),
        ({"TIERED_KV_KV_CODEC": "gzip"}, "--kv-codec is not usable: unknown codec spec 'gzip'"),
        ({"TIERED_KV_CONFIG": "no\nsuch.yaml"}, "--config no such.yaml: No such file or directory"),
    ],
)
def test_a_hostile_environment_value_is_one_line_naming_it(environ, message):
    with pytest.raises(ValueError) as info:
        ServeConfig.load(environ=environ)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)[:1000]


def test_a_valid_config_has_a_request_body_limit_in_bytes():
    """1e308 MiB passed the check, then int(inf) failed as the server started."""
    with pytest.raises(ValueError, match="--max-request-body-mib"):
        ServeConfig(max_request_body_mib=1e308)
    assert ServeConfig(max_request_body_mib=10**30).max_request_body_bytes == 10**30 << 20


def test_the_cli_refuses_a_structure_in_the_config_file_in_one_line(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("dtype: [float16]\n")  # was TypeError (unhashable) and a traceback
    result = CliRunner().invoke(app, ["serve", "--config", str(path)], env={})
    assert result.exit_code == 2
    assert result.output == f"error: --config {path}: dtype: expected text, a number or a boolean, got a list\n"


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"port": 0}, "--port"),
        ({"port": 70000}, "--port"),
        ({"max_queue_len": -1}, "--max-queue-len"),
        ({"max_request_body_mib": 0}, "--max-request-body-mib"),
        ({"max_request_body_mib": float("inf")}, "--max-request-body-mib"),
        ({"log_level": "loud"}, "--log-level"),
        ({"block_size": 12}, "--block-size"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"kv_cache_dtype": "int3"}, "--kv-cache-dtype"),
        ({"dtype": "float8"}, "--dtype"),
        ({"kv_offloading_size": -1.0}, "--kv-offloading-size"),
        ({"kv_disk_size": float("nan")}, "--kv-disk-size"),
        ({"kv_write_policy": "sometimes"}, "--kv-write-policy"),
        ({"kv_offload": "none"}, "--kv-offload"),
        ({"kv_write_policy": "write-back", "kv_offloading_size": 0}, "--kv-write-policy write-back"),
        ({"kv_codec": "gzip"}, "codec"),
        ({"device": "tpu"}, "--device"),
        ({"api_key": ""}, "--api-key"),
        ({"kv_remote_url": "http://cache:6379"}, "--kv-remote-url"),
        ({"kv_remote_url": "redis://c", "kv_remote_write_policy": "x"}, "--kv-remote-write-policy"),
        ({"kv_remote_url": "redis://c", "kv_remote_timeout": 0.0}, "--kv-remote-timeout"),
        ({"kv_remote_url": "redis://c", "kv_remote_ttl": 0}, "--kv-remote-ttl"),
    ],
)
def test_invalid_values_name_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        ServeConfig(**fields)


def test_tiers_turn_off_with_size_zero():
    assert ServeConfig(kv_offloading_size=0, kv_disk_size=0).tier_config() is None
    cpu_only = ServeConfig(kv_disk_size=0).tier_config()
    assert cpu_only.kv_cache_dir is None and cpu_only.has_cpu
    disk_only = ServeConfig(kv_offloading_size=0, kv_cache_dir="/tmp/x").tier_config()
    assert not disk_only.has_cpu and disk_only.kv_cache_dir == "/tmp/x"


def test_remote_tier_from_the_environment():
    env = {"TIERED_KV_KV_REMOTE_URL": "valkey://:pw@cache:6379/0",
           "TIERED_KV_KV_REMOTE_WRITE_POLICY": "read-only", "TIERED_KV_KV_REMOTE_TTL": "3600"}
    c = ServeConfig.load({}, environ=env)
    tiers = c.tier_config()
    assert tiers.remote_url == "valkey://:pw@cache:6379/0" and tiers.has_remote
    assert (tiers.remote_write_policy, tiers.remote_ttl_s, tiers.remote_timeout_s) == (
        "read-only", 3600, 0.1
    )
    remote_only = ServeConfig(kv_offloading_size=0, kv_disk_size=0, kv_remote_url="redis://c")
    assert remote_only.tier_config().has_remote


def test_engine_kwargs_cover_the_engine_flags():
    c = ServeConfig(max_model_len=300, num_gpu_blocks_override=9, enable_prefix_caching=False)
    config = c.engine_config()
    assert (config.max_model_len, config.num_gpu_blocks_override, config.enable_prefix_caching) == (300, 9, False)
    assert dataclasses.replace(c, port=1).port == 1  # frozen, replace works


def test_cli_flags_are_generated_from_the_config_fields():
    command = next(c for c in app.registered_commands if c.name == "serve")
    params = set(inspect.signature(command.callback).parameters)
    flags = {s.name for s in SETTINGS if s.option.flag}
    assert flags <= params and "secret" not in params
    assert flags == {f.name for f in dataclasses.fields(ServeConfig)} - {"secret"}
    assert {"config", "model_tag"} <= params


def test_cli_rejects_bad_values_with_exit_code_2(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--port", "0"], env={})
    assert result.exit_code == 2
    assert "--port" in result.output and "Traceback" not in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("nonsense: 1\n")
    result = runner.invoke(app, ["serve", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown key" in result.output


def test_cli_help_explains_every_flag():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    for setting in SETTINGS:
        assert (setting.flag in result.output) == setting.option.flag, setting.name
        assert setting.option.help, f"{setting.name} has no help"
    assert "--no-enable-prefix-caching" in result.output and "--config" in result.output
    assert "--secret " not in result.output and "--trust-remote-code" in result.output


def test_cli_reports_a_missing_model_without_a_traceback(tmp_path):
    result = CliRunner().invoke(
        app, ["serve", "--model", str(tmp_path / "missing"), "--kv-disk-size", "0"], env={}
    )
    assert result.exit_code == 2
    assert "no such model folder" in result.output and "Traceback" not in result.output


def test_a_busy_port_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, [
            "serve", "--port", str(port), "--model", str(tmp_path / "missing"),
            "--kv-disk-size", "0",
        ], env={})
    assert result.exit_code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.output  # not "no such model folder"
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("8k", 8000), ("8K", 8192), ("25.6k", 25600), ("1m", 10**6), ("2M", 2 << 20),
     ("1g", 10**9), ("1G", 1 << 30), ("1T", 1 << 40), (" 16 ", 16)],
)
def test_token_counts_take_vllms_suffixes(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["8x", "1.5K", "k", "", "8 k"])
def test_token_counts_refuse_other_spellings(text):
    with pytest.raises(ValueError):
        human_readable_int(text)


def test_sizes_parse_alike_from_flags_environment_and_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-batched-tokens: 4K\ncpu-kv-cache-bytes: 1g\n")
    c = ServeConfig.load({"max_model_len": "8k"}, config_file=path, environ={"TIERED_KV_SEED": "7"})
    assert (c.max_model_len, c.max_num_batched_tokens, c.cpu_kv_cache_bytes, c.seed) == (8000, 4096, 10**9, 7)
    assert c.engine_config().cpu_kv_cache_bytes == 10**9
    assert ServeConfig.load({"max_model_len": "auto"}, environ={}).max_model_len is None
    with pytest.raises(ValueError, match=r"--max-model-len '8x': not an integer"):
        ServeConfig.load({"max_model_len": "8x"}, environ={})
    with pytest.raises(ValueError, match="TIERED_KV_MAX_MODEL_LEN='1.5K'"):
        ServeConfig.load(environ={"TIERED_KV_MAX_MODEL_LEN": "1.5K"})


def test_vllm_cpu_kvcache_space_is_gib_below_our_own_variable():
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert ServeConfig.load(environ=env).cpu_kv_cache_bytes == 2 * GiB
    assert ServeConfig.load(environ={"VLLM_CPU_KVCACHE_SPACE": "0"}).cpu_kv_cache_bytes == 256 << 20
    both = {**env, "TIERED_KV_CPU_KV_CACHE_BYTES": "64M"}
    assert ServeConfig.load(environ=both).cpu_kv_cache_bytes == 64 << 20
    assert ServeConfig.load({"cpu_kv_cache_bytes": "1G"}, environ=both).cpu_kv_cache_bytes == GiB
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        ServeConfig.load(environ={"VLLM_CPU_KVCACHE_SPACE": "lots"})


def test_the_hugging_face_cache_comes_from_its_environment_variables():
    assert ServeConfig.load(environ={}).download_dir is None
    assert ServeConfig.load(environ={"XDG_CACHE_HOME": "/c"}).download_dir == "/c/huggingface/hub"
    assert ServeConfig.load(environ={"HF_HOME": "/hf", "XDG_CACHE_HOME": "/c"}).download_dir == "/hf/hub"
    env = {"HF_HOME": "/hf", "HF_HUB_CACHE": "/hub"}
    assert ServeConfig.load(environ=env).download_dir == "/hub"
    assert ServeConfig.load({"download_dir": "/d"}, environ=env).download_dir == "/d"


def test_vllm_engine_flags_reach_the_engine():
    c = ServeConfig.load({
        "kv_cache_dtype": "fp8_e4m3", "enable_chunked_prefill": False, "enforce_eager": True,
        "scheduling_policy": "priority", "tensor_parallel_size": "1", "device": "cpu",
    }, environ={})
    config = c.engine_config()
    assert config.device == "cpu" and config.torch_device.type == "cpu"
    assert (config.kv_cache_dtype, config.enable_chunked_prefill, config.enforce_eager) == ("fp8", False, True)
    assert config.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported: the engine stores fp8 KV as e4m3"):
        ServeConfig.load({"kv_cache_dtype": "fp8_e5m2"}, environ={})
    with pytest.raises(ValueError, match="--scheduling-policy must be one of fcfs, priority"):
        ServeConfig(scheduling_policy="lifo")
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ValueError, match="only 1 is supported: this server runs the model on one device"):
            ServeConfig.load({flag: "2"}, environ={})


def test_cors_lists_parse_as_json_or_commas(tmp_path):
    c = ServeConfig.load({"allowed_origins": '["https://a.example", "https://b.example"]'}, environ={
        "TIERED_KV_ALLOWED_METHODS": "GET, POST", "TIERED_KV_ALLOW_CREDENTIALS": "true",
    })
    assert c.allowed_origins == ("https://a.example", "https://b.example")
    assert c.allowed_methods == ("GET", "POST") and c.allow_credentials is True
    path = tmp_path / "cors.yaml"
    path.write_text("allowed-origins: ['*']\n")
    assert ServeConfig.load(config_file=path, environ={}).allowed_origins == ("*",)
    with pytest.raises(ValueError, match="--allowed-origins"):
        ServeConfig.load({"allowed_origins": '["a", 1]'}, environ={})


def test_the_secret_is_environment_only_and_never_shown(tmp_path):
    c = ServeConfig.load(environ={"TIERED_KV_SECRET": "s3cr3t-value"})
    assert c.secret == "s3cr3t-value" and c.tier_config().remote_secret == "s3cr3t-value"
    assert "s3cr3t-value" not in repr(c) and "s3cr3t-value" not in repr(c.tier_config())
    with pytest.raises(ValueError, match="unknown setting 'secret'"):
        ServeConfig.load({"secret": "x"}, environ={})
    path = tmp_path / "secret.yaml"
    path.write_text("secret: x\n")
    with pytest.raises(ValueError, match="read only from the environment"):
        ServeConfig.load(config_file=path, environ={})
    result = CliRunner().invoke(app, ["serve", "--secret", "x"], env={})
    assert result.exit_code == 2 and "No such option: --secret" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--colour", "blue"], "error: No such option: --colour"),
        (["--port"], "error: Option '--port' requires an argument."),
        (["--max-model-len", "lots"], "error: --max-model-len 'lots': not an integer"),
        (["--quantization", "awq"], "error: --quantization is not supported: quantized checkpoints"),
        (["--enable-lora"], "error: --enable-lora is not supported: LoRA adapters"),
        (["-tp", "4"], "error: --tensor-parallel-size 4: only 1 is supported"),
        (["a", "b"], "error: Got unexpected extra argument(s) (b)"),
        (["m1", "--model", "m2"], "error: the model is given twice"),
    ],
)
def test_cli_usage_errors_are_one_line(args, message):
    result = CliRunner().invoke(app, ["serve", *args], env={})
    assert result.exit_code == 2
    assert result.output.startswith(message) and result.output.count("\n") == 1, result.output


def test_a_hugging_face_id_missing_from_the_cache_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["serve", "acme/absent-model", "--kv-disk-size", "0"], env={
        "HF_HUB_CACHE": str(tmp_path),
    })
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"acme/absent-model: no such model folder, and not in the Hugging Face cache {tmp_path}" in result.output


def _served(monkeypatch, args: list[str], env: dict[str, str] | None = None) -> ServeConfig:
    """The settings ``tiered-kv serve ARGS`` would run with (the server itself not started)."""
    from tiered_kv import server

    got = []
    monkeypatch.setattr(server, "run", lambda settings, ignored_flags=(): got.append(settings))
    result = CliRunner().invoke(app, ["serve", *args], env=env or {})
    assert result.exit_code == 0, result.output
    return got[0]


def test_names_and_keys_take_several_values_as_vllms(monkeypatch):
    """vLLM's `--served-model-name a b` and `--api-key k1 k2` (nargs="+"): every word up to
    the next flag; a key may hold a comma."""
    c = _served(monkeypatch, ["tiny", "--served-model-name", "alpha", "beta", "--api-key", "k,1", "k2", "--port", "9000"])
    assert c.model == "tiny" and c.served_model_name == ("alpha", "beta") and c.model_name == "alpha"
    assert c.model_names == ("alpha", "beta") and c.api_key == ("k,1", "k2") and c.port == 9000
    one = _served(monkeypatch, ["--api-key=only", "--served-model-name", "solo"])
    assert one.api_key == ("only",) and one.model_names == ("solo",)
    assert _served(monkeypatch, []).model_names == ("tiny",)


def test_vllm_api_key_sets_the_key_below_our_own_variable():
    assert ServeConfig.load(environ={"VLLM_API_KEY": "a,b"}).api_key == ("a,b",)  # one key
    both = {"VLLM_API_KEY": "v", "TIERED_KV_API_KEY": '["t1", "t2"]'}
    assert ServeConfig.load(environ=both).api_key == ("t1", "t2")
    assert ServeConfig.load({"api_key": "flag"}, environ=both).api_key == ("flag",)
    assert ServeConfig(api_key="k").api_key == ("k",)  # the Python API takes one key too
    # as vLLM: an empty variable (compose's ${KEY:-}) is no key, not a start-up error
    assert ServeConfig.load(environ={"VLLM_API_KEY": ""}).api_key == ()
