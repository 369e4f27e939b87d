"""The node's typed option table: STRATA_* variables over an optional YAML file over defaults.

Why one module: the table is the one place an operator reads every option (its name, default and
help, in the order `strata_node --help` prints them), and `NodeConfig`, whose fields mirror it one
for one, is built from it here (`load_config`); the parsers and checks live in `config_values`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from worker.dataplane.blend.options import (
    parse_model_percents,
    parse_namespace_percents,
)
from worker.dataplane.config_values import (
    FAULT_POINTS,
    VERIFY_MODES,
    TierList,
    check_at_least_one,
    check_between,
    check_fraction,
    check_heartbeat,
    check_non_negative,
    check_percent,
    check_positive,
    check_step_percent,
    parse_api_keys,
    parse_args,
    parse_bool,
    parse_choice,
    parse_engine,
    parse_float,
    parse_int,
    parse_namespace,
    parse_native_copy,
    parse_node_group,
    parse_node_name,
    parse_path,
    parse_pool_name,
    parse_postgres_url,
    parse_seconds,
    parse_selection,
    parse_size,
    parse_str,
    parse_tiers,
)
from worker.dataplane.tier_names import DISK, REMOTE, TIER_ORDER


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One row of the option table."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    description: str
    check: Callable[[Any], str | None] | None = None

    @property
    def env_var(self) -> str:
        return "STRATA_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("node_name", parse_node_name, "gpu-0", "Name of this node; its Celery queue is node.<name>."),
    Option(
        "node_group",
        parse_node_group,
        "default",
        "Group of this node; tier policies for the group override the fleet-wide ones.",
    ),
    Option("node_address", parse_str, "", "Address other nodes and the control plane reach this node at (host:port)."),
    Option(
        "heartbeat_seconds",
        parse_float,
        5.0,
        "Seconds between node heartbeats (0.1 to 3600); 3 missed make the node stale.",
        check_heartbeat,
    ),
    Option(
        "device_bytes",
        parse_size,
        256 * 1024**2,
        "L1 device pool capacity (GPU memory, CPU memory where no GPU).",
        check_non_negative,
    ),
    Option(
        "host_bytes",
        parse_size,
        1024**3,
        "L2 DRAM pool capacity (POSIX shared memory on the node).",
        check_non_negative,
    ),
    Option("disk_bytes", parse_size, 4 * 1024**3, "L2 NVMe tier capacity.", check_non_negative),
    Option(
        "disk_path",
        parse_path,
        Path("{var}/nodes/{node}/disk"),
        "Directory of the NVMe tier; {node} is replaced by the node name, {var} by STRATA_VAR_DIR (default ./var).",
    ),
    Option(
        "remote_bytes",
        parse_size,
        16 * 1024**3,
        "L3 remote tier capacity accounted to this deployment.",
        check_non_negative,
    ),
    Option(
        "remote_url",
        parse_str,
        "",
        "L3 store: redis:// or unix:// URL of a Redis/Valkey, or a directory path of a shared filesystem mount. Empty:"
        " REDIS_URL.",
    ),
    Option("remote_prefix", parse_str, "strata", "Key prefix of this deployment in the remote tier."),
    Option("worker_concurrency", parse_int, 4, "Threads executing this node's Celery tasks.", check_positive),
    Option(
        "tiers",
        parse_tiers,
        TierList(TIER_ORDER),
        "Tiers this node stores blocks in (comma-separated; looked up fastest first): device, host, disk, remote.",
    ),
    Option(
        "host_pool_name",
        parse_pool_name,
        "strata-{node}",
        "Name of the node's shared-memory DRAM pool in /dev/shm ({node} = node name); one pool per model, suffixed "
        "with its model key.",
    ),
    Option(
        "disk_direct_io",
        parse_bool,
        True,
        "Use O_DIRECT for the disk tier where the filesystem allows it (else buffered I/O with posix_fadvise "
        "DONTNEED).",
    ),
    Option(
        "io_threads",
        parse_int,
        2,
        "I/O threads of the remote tier (outstanding reads and writes); a remote on a shared filesystem mount too.",
        check_positive,
    ),
    Option(
        "disk_io_threads",
        parse_int,
        4,
        "I/O threads of the disk tier: reads in flight at once, each hashed as it lands by the thread that read it.",
        check_positive,
    ),
    Option(
        "disk_reuse_seconds",
        parse_float,
        10.0,
        "Seconds a deleted disk block's file is kept (its bytes counted as used) for a put of the same process to "
        "write over instead of creating a file; 0: unlinked at once.",
        check_non_negative,
    ),
    Option(
        "copy_threads",
        parse_int,
        0,
        "Threads that copy and checksum blocks in memory; 0 = min(4, CPU count).",
        check_non_negative,
    ),
    Option(
        "native_copy",
        parse_native_copy,
        "1",
        "Fused copy-and-hash: 1 = the build for this CPU (AVX2 where present), sse2 = the baseline build, 0 = hash in "
        "Python.",
    ),
    Option(
        "move_verify",
        parse_choice(VERIFY_MODES),
        "full",
        "How a moved copy is verified before its flip: full reads it back from the target and checks every byte; "
        "header compares the checksum the target stored with the source's.",
    ),
    Option(
        "reconcile_grace_s",
        parse_seconds,
        300.0,
        "Seconds bytes without a placement must stay orphaned (seen by an earlier reconcile) before the reconciler "
        "deletes them.",
        check_non_negative,
    ),
    Option(
        "fault_point",
        parse_choice(FAULT_POINTS, empty=True),
        "",
        "Tests only: after-reserve, after-copy or after-flip makes movements hold there (logged) so a test can kill or"
        " stop the worker; empty: off.",
    ),
    Option("fault_hold_s", parse_seconds, 3600.0, "Seconds a movement holds at fault_point.", check_non_negative),
    Option("remote_cluster", parse_bool, False, "remote_url points at a Redis Cluster (redis-py RedisCluster)."),
    Option(
        "remote_timeout_seconds",
        parse_float,
        2.0,
        "Socket timeout of the remote tier; past it the tier is unavailable and callers recompute.",
        check_positive,
    ),
    Option(
        "db_connect_timeout_seconds",
        parse_int,
        2,
        "Seconds a node's PostgreSQL connection may take to open (the directory client's and the node's own; 2 to "
        "60, libpq's minimum is 2).",
        check_between(2, 60, "seconds"),
    ),
    Option(
        "db_statement_timeout_seconds",
        parse_float,
        30.0,
        "Statement timeout of a node's PostgreSQL connections (0.1 to 3600): the server cancels a statement past it;"
        " the directory's writes are cut this long plus 5 s after they were sent when no answer comes (retried "
        "later). Lookups keep their own 250 ms.",
        check_between(0.1, 3600, "seconds"),
    ),
    Option(
        "tcp_keepalive_idle_seconds",
        parse_int,
        5,
        "Seconds a node's PostgreSQL or Redis connection sits idle before TCP probes the peer (1 to 3600).",
        check_between(1, 3600, "seconds"),
    ),
    Option(
        "tcp_keepalive_interval_seconds",
        parse_int,
        2,
        "Seconds between two unanswered TCP keepalive probes (1 to 600).",
        check_between(1, 600, "seconds"),
    ),
    Option(
        "tcp_keepalive_count",
        parse_int,
        3,
        "Unanswered TCP keepalive probes after which a connection is dead (1 to 50).",
        check_between(1, 50, "probes"),
    ),
    Option(
        "tcp_user_timeout_seconds",
        parse_float,
        10.0,
        "Seconds bytes a node sent to PostgreSQL or Redis may stay unacknowledged before the connection is dead "
        "(TCP_USER_TIMEOUT; 0.5 to 600): a path that drops packets fails in seconds, not TCP's 15 minutes.",
        check_between(0.5, 600, "seconds"),
    ),
    Option(
        "redis_health_check_seconds",
        parse_float,
        15.0,
        "A node's Redis connection (the remote tier's, the broker's) idle this long is PINGed before its next "
        "command (0 to 3600; 0: never).",
        check_between(0, 3600, "seconds"),
    ),
    Option(
        "broker_timeout_seconds",
        parse_float,
        10.0,
        "Seconds the node's Celery broker connection waits to connect (2 to 300); a dead broker is found by "
        "keepalives and health checks.",
        check_between(2, 300, "seconds"),
    ),
    Option(
        "model",
        parse_str,
        "",
        "Model the node's engine serves: a preset (tiny, small, bench, ...), a local checkpoint directory, or a "
        "Hugging Face repository id (org/name) already in the local hub cache (HF_HUB_CACHE, HF_HOME; nothing is "
        "downloaded). Empty: no engine.",
    ),
    Option(
        "cache_dir",
        parse_str,
        "",
        "Directory of the node's own cache: the content digest of a checkpoint whose directory is read-only (a "
        "writable checkpoint keeps it beside its files). Empty: $XDG_CACHE_HOME/strata, else ~/.cache/strata.",
    ),
    Option(
        "engine",
        parse_engine,
        "strata",
        "Engine serving the model: strata (the node's own server) or vllm (a vLLM OpenAI server on serve_port with "
        "Strata as its KV connector).",
    ),
    Option(
        "vllm_args",
        parse_args,
        (),
        "Extra arguments of the vLLM server (engine vllm), as on its command line, e.g. --max-model-len 16384 "
        "--num-gpu-blocks-override 256.",
    ),
    Option(
        "vllm_launch",
        parse_bool,
        True,
        "With engine vllm: the node starts (and stops) the vLLM server itself; false: a vLLM server started elsewhere "
        "with the connector serves, and the node runs its worker beside it.",
    ),
    Option(
        "load_staging_bytes",
        parse_size,
        512 * 1024**2,
        "vLLM connector: memory a step's loads are staged in on their way into vLLM's pages (pinned host memory on "
        "a GPU, outside vLLM's own budget); a load larger than it goes in pieces. At least one layer of one block.",
        check_positive,
    ),
    Option(
        "save_staging_bytes",
        parse_size,
        256 * 1024**2,
        "vLLM connector: memory the blocks a step saves wait in, copied out of vLLM's pages inside the step, while "
        "a thread stores and registers them outside it; when it is full, blocks are stored inside the step. "
        "0: every save inside the step.",
        check_non_negative,
    ),
    Option(
        "async_load_tiers",
        parse_tiers,
        TierList((DISK, REMOTE)),
        "vLLM connector: tiers whose hits load outside vLLM's engine step (the request waits for its KV while the "
        "others compute); a hit held in none of them loads layer by layer inside the step. Empty: every hit inside.",
    ),
    Option(
        "load_deadline_seconds",
        parse_float,
        30.0,
        "The longest a load may take (vLLM connector: an asynchronous one in all, a layer's wait inside the step; "
        "the node's own engine: its layer waits); past it the load is given up and the tokens are recomputed "
        "(counted load_deadlines).",
        check_positive,
    ),
    Option(
        "lookup_deadline_seconds",
        parse_float,
        5.0,
        "The longest a request waits for its lookup (the directory's round trip), in either engine; past it the "
        "request is served without the cache (counted lookup_deadlines), and the directory client cuts a read "
        "still waiting for its answer.",
        check_positive,
    ),
    Option(
        "directory_replica_url",
        parse_postgres_url,
        "",
        "postgresql:// URL of a streaming read replica (hot standby) of the directory's database; empty: none. "
        "Lookups and salts go to it while its measured staleness is within directory_replica_max_lag_seconds, to "
        "the primary otherwise or when it fails; writes always go to the primary.",
    ),
    Option(
        "directory_replica_max_lag_seconds",
        parse_seconds,
        1.0,
        "The most the read replica may lag the primary and still answer lookups (measured, not assumed): a block "
        "registered this recently may be a miss there (recomputed), never a wrong hit.",
        check_positive,
    ),
    Option(
        "status_port",
        parse_int,
        0,
        "Port of a vLLM node's Strata endpoints (/metrics, /v1/strata/requests, /v1/strata/blend): the node's "
        "address for the control plane; 0 = serve_port + 1000.",
        check_non_negative,
    ),
    Option(
        "model_dtype",
        parse_str,
        "",
        "Model dtype (float32, bfloat16, float16); empty: the preset's or checkpoint's own.",
    ),
    Option("block_tokens", parse_int, 256, "Tokens per KV block.", check_positive),
    Option("serve_host", parse_str, "127.0.0.1", "Interface the node's OpenAI-compatible server listens on."),
    Option(
        "serve_port", parse_int, 9100, "Port of the node's OpenAI-compatible server (with a model).", check_non_negative
    ),
    Option(
        "api_keys",
        parse_api_keys,
        {},
        "Tenants' API keys as key=namespace pairs, comma-separated: a request's key names its namespace (node "
        "server; vLLM through NamespaceMiddleware). Empty: no key needed.",
    ),
    Option(
        "namespace_header",
        parse_str,
        "",
        "Header a trusted gateway sets to name a request's namespace (when no API key does), e.g. X-Strata-Namespace;"
        " empty: no header is trusted.",
    ),
    Option(
        "client_namespaces",
        parse_bool,
        False,
        "Honour a namespace a client names itself (X-Strata-Namespace on the node server, kv_transfer_params."
        "strata_namespace in vLLM): any client may then use any namespace's quota (never its blocks: keys carry the "
        "cache salt).",
    ),
    Option(
        "default_namespace",
        parse_namespace,
        "default",
        "Namespace of a request that no API key, trusted header or allowed client claim places.",
    ),
    Option(
        "namespace_secret",
        parse_str,
        "",
        "Secret with which vLLM's API server vouches to the connector for a namespace it read from an API key or a "
        "trusted header (a node that launches vLLM makes one when empty).",
    ),
    Option(
        "blend",
        parse_bool,
        False,
        "Reuse blocks found anywhere in a prompt (content match, RoPE re-alignment, selective recompute), not only the"
        " prefix.",
    ),
    Option(
        "blend_recompute_percent",
        parse_float,
        15.0,
        "r: percent of reused fragment tokens recomputed (those whose KV deviates most).",
        check_percent,
    ),
    Option(
        "blend_namespace_percent",
        parse_namespace_percents,
        {},
        "r per namespace as namespace=percent or model/namespace=percent pairs, comma-separated. r of a namespace: its"
        " model/namespace entry, else its namespace entry, else its model's blend_model_percent entry, else "
        "blend_recompute_percent.",
    ),
    Option(
        "blend_model_percent",
        parse_model_percents,
        {},
        "r per model as model=percent pairs, comma-separated: the r of that model's namespaces without an entry of "
        "their own (a fleet-wide setting for nodes of different models).",
    ),
    Option(
        "blend_selection",
        parse_selection,
        "deviation",
        "How the fragment tokens to recompute are chosen: deviation (CacheBlend: largest KV deviation at the check "
        "layer) or chunk-start (EPIC: the first tokens of every reused run).",
    ),
    Option(
        "blend_check_layer",
        parse_int,
        1,
        "Layer whose KV deviation picks the tokens to recompute (deviation selection); layers before it are computed "
        "for every token.",
        check_at_least_one,
    ),
    Option(
        "blend_sample_rate",
        parse_float,
        0.05,
        "Share of blended requests also run with a full prefill in the background to measure agreement.",
        check_fraction,
    ),
    Option(
        "blend_agreement_threshold",
        parse_float,
        0.9,
        "Below this share of agreeing samples r is raised for the namespace, then it falls back to prefix-only.",
        check_fraction,
    ),
    Option(
        "blend_max_kl",
        parse_float,
        0.1,
        "A sample agrees when blend and full prefill choose the same first token and KL(full || blend) is at most "
        "this.",
        check_non_negative,
    ),
    Option(
        "blend_min_samples",
        parse_int,
        20,
        "Samples of a namespace judged together before r is raised or the namespace falls back.",
        check_at_least_one,
    ),
    Option(
        "blend_raise_step_percent",
        parse_float,
        15.0,
        "Percent added to r each time a namespace's agreement is below the threshold.",
        check_step_percent,
    ),
    Option(
        "blend_max_percent",
        parse_float,
        60.0,
        "Highest r the auto-tuner raises to; poor agreement at it falls back to prefix-only.",
        check_percent,
    ),
    Option(
        "blend_min_fragment_blocks",
        parse_int,
        1,
        "Fewest reused fragment blocks that make a request blend (fewer: prefix-only for that request).",
        check_at_least_one,
    ),
    Option(
        "blend_reprobe_seconds",
        parse_float,
        600.0,
        "Seconds after a fallback before the namespace blends again at the r it fell back at (each failed probe "
        "doubles the wait, up to 16x); 0: only an operator resumes it.",
        check_non_negative,
    ),
    Option(
        "node_admin_key",
        parse_str,
        "",
        "Key (Authorization: Bearer) of the node's operator endpoints (/v1/strata/requests, /v1/strata/blend); the "
        "control plane reads the node with it: the node's own key, issued with its credential "
        "(strata_node_credential), or the fleet-wide one for a node without a credential. "
        "STRATA_NODE_ADMIN_KEY_FILE names a file holding it instead. Empty: those endpoints are refused (a "
        "tenant's API key still reads its own requests).",
    ),
)

_BY_NAME = {option.name: option for option in OPTIONS}


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Validated node options. Build with `load_config`."""

    node_name: str
    node_address: str
    heartbeat_seconds: float
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    disk_path: Path
    remote_bytes: int
    remote_url: str
    remote_prefix: str
    worker_concurrency: int
    tiers: TierList = TierList(TIER_ORDER)
    host_pool_name: str = "strata-{node}"
    disk_direct_io: bool = True
    io_threads: int = 2
    disk_io_threads: int = 4
    disk_reuse_seconds: float = 10.0
    copy_threads: int = 0
    native_copy: str = "1"
    move_verify: str = "full"
    reconcile_grace_s: float = 300.0
    fault_point: str = ""
    fault_hold_s: float = 3600.0
    remote_cluster: bool = False
    remote_timeout_seconds: float = 2.0
    db_connect_timeout_seconds: int = 2
    db_statement_timeout_seconds: float = 30.0
    tcp_keepalive_idle_seconds: int = 5
    tcp_keepalive_interval_seconds: int = 2
    tcp_keepalive_count: int = 3
    tcp_user_timeout_seconds: float = 10.0
    redis_health_check_seconds: float = 15.0
    broker_timeout_seconds: float = 10.0
    model: str = ""
    cache_dir: str = ""
    model_dtype: str = ""
    engine: str = "strata"
    vllm_args: tuple[str, ...] = ()
    vllm_launch: bool = True
    load_staging_bytes: int = 512 * 1024**2
    save_staging_bytes: int = 256 * 1024**2
    async_load_tiers: TierList = TierList((DISK, REMOTE))
    load_deadline_seconds: float = 30.0
    lookup_deadline_seconds: float = 5.0
    directory_replica_url: str = dataclasses.field(default="", repr=False)
    directory_replica_max_lag_seconds: float = 1.0
    status_port: int = 0
    block_tokens: int = 256
    serve_host: str = "127.0.0.1"
    serve_port: int = 9100
    api_keys: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    namespace_header: str = ""
    client_namespaces: bool = False
    default_namespace: str = "default"
    namespace_secret: str = dataclasses.field(default="", repr=False)
    node_group: str = "default"
    blend: bool = False
    blend_recompute_percent: float = 15.0
    blend_namespace_percent: dict[str, float] = dataclasses.field(default_factory=dict)
    blend_model_percent: dict[str, float] = dataclasses.field(default_factory=dict)
    blend_selection: str = "deviation"
    blend_check_layer: int = 1
    blend_sample_rate: float = 0.05
    blend_agreement_threshold: float = 0.9
    blend_max_kl: float = 0.1
    blend_min_samples: int = 20
    blend_raise_step_percent: float = 15.0
    blend_max_percent: float = 60.0
    blend_min_fragment_blocks: int = 1
    blend_reprobe_seconds: float = 600.0
    node_admin_key: str = dataclasses.field(default="", repr=False)

    @property
    def node_disk_path(self) -> Path:
        var = os.environ.get("STRATA_VAR_DIR") or "var"
        return Path(str(self.disk_path).replace("{node}", self.node_name).replace("{var}", var))

    @property
    def node_status_port(self) -> int:
        """The port of a vLLM node's Strata endpoints."""
        return self.status_port or self.serve_port + 1000

    @property
    def node_host_pool_name(self) -> str:
        return self.host_pool_name.replace("{node}", self.node_name)


def load_config(
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    yaml_path: str | Path | None = None,
) -> NodeConfig:
    """Options by precedence: explicit overrides (command-line flags) > STRATA_* variables >
    the YAML file (STRATA_CONFIG_FILE or `yaml_path`) > defaults. Raises ConfigError naming the
    option and the source of the bad value."""
    environ = os.environ if environ is None else environ
    yaml_path = yaml_path or environ.get("STRATA_CONFIG_FILE") or None
    from_yaml: dict[str, Any] = {}
    if yaml_path:
        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text())
        except OSError as exc:
            raise ConfigError(f"STRATA_CONFIG_FILE: cannot read {yaml_path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"STRATA_CONFIG_FILE: {yaml_path} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"STRATA_CONFIG_FILE: {yaml_path} must hold a mapping of option names")
        unknown = sorted(set(loaded) - set(_BY_NAME))
        if unknown:
            raise ConfigError(f"STRATA_CONFIG_FILE: unknown option(s) {', '.join(unknown)} in {yaml_path}")
        from_yaml = loaded
    unknown = sorted(set(overrides or {}) - set(_BY_NAME))
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(unknown)}")

    environ = _admin_key_from_file(environ)
    values: dict[str, Any] = {}
    for option in OPTIONS:
        if overrides and overrides.get(option.name) is not None:
            raw, source = overrides[option.name], f"--{option.name.replace('_', '-')}"
        elif option.env_var in environ:
            raw, source = environ[option.env_var], option.env_var
        elif option.name in from_yaml:
            raw, source = from_yaml[option.name], f"{option.name} in {yaml_path}"
        else:
            values[option.name] = option.default
            continue
        values[option.name] = _parsed(option, raw, source)
    return NodeConfig(**values)


def _admin_key_from_file(environ: Mapping[str, str]) -> Mapping[str, str]:
    """`environ` with STRATA_NODE_ADMIN_KEY read from the file STRATA_NODE_ADMIN_KEY_FILE names
    (as `strata_node_credential --url-dir` writes it), when that is set; ConfigError when the file
    is unreadable or empty, or the variable is set beside it."""
    path = environ.get("STRATA_NODE_ADMIN_KEY_FILE", "").strip()
    if not path:
        return environ
    if "STRATA_NODE_ADMIN_KEY" in environ:
        raise ConfigError("STRATA_NODE_ADMIN_KEY_FILE: set beside STRATA_NODE_ADMIN_KEY; set one of them")
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"STRATA_NODE_ADMIN_KEY_FILE: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"STRATA_NODE_ADMIN_KEY_FILE: {path} is not text ({exc.reason})") from exc
    if not key:
        raise ConfigError(f"STRATA_NODE_ADMIN_KEY_FILE: {path} is empty")
    return {**environ, "STRATA_NODE_ADMIN_KEY": key}


def _parsed(option: Option, raw: Any, source: str) -> Any:
    """`raw` parsed and checked as `option`'s value; ConfigError naming `source` when invalid."""
    try:
        value = option.parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    if option.check is not None and (problem := option.check(value)):
        raise ConfigError(f"{source}: {problem}, got {raw!r}")
    return value


def option_from_environ(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One option from its STRATA_* variable alone, else its default: for a process that reads an
    option before (or without) loading a node configuration. Raises ConfigError naming the variable."""
    option = _BY_NAME[name]
    environ = os.environ if environ is None else environ
    if option.env_var not in environ:
        return option.default
    return _parsed(option, environ[option.env_var], option.env_var)


def describe_options() -> list[dict[str, str]]:
    """The option table as rows (for the README and `strata_node --help`)."""
    return [{"variable": o.env_var, "default": str(o.default), "description": o.description} for o in OPTIONS]
