"""The node option table: precedence, sizes, and bad values named with their source."""

from pathlib import Path

import pytest

from worker.dataplane.config import ConfigError, load_config, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9), ("1048576", 1048576), (" 1.5 GiB", int(1.5 * 1024**3)), (0, 0)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_precedence_flag_over_env_over_yaml_over_default(tmp_path):
    config_file = tmp_path / "node.yaml"
    config_file.write_text("host_bytes: 3GiB\ndisk_bytes: 5GiB\nnode_name: from-yaml\n")
    config = load_config(
        overrides={"node_name": "from-flag"},
        environ={"STRATA_CONFIG_FILE": str(config_file), "STRATA_HOST_BYTES": "2GiB", "STRATA_NODE_NAME": "from-env"},
    )
    assert config.node_name == "from-flag"
    assert config.host_bytes == 2 * 1024**3
    assert config.disk_bytes == 5 * 1024**3
    assert config.device_bytes == 256 * 1024**2


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"STRATA_HOST_BYTES": "lots"}, "STRATA_HOST_BYTES: expected a size"),
        ({"STRATA_HEARTBEAT_SECONDS": "0"}, "STRATA_HEARTBEAT_SECONDS: must be 0.1 to 3600 seconds"),
        ({"STRATA_HEARTBEAT_SECONDS": "7200"}, "STRATA_HEARTBEAT_SECONDS: must be 0.1 to 3600 seconds"),
        ({"STRATA_NODE_NAME": "GPU 0"}, "STRATA_NODE_NAME: expected 1-63 lowercase"),
        ({"STRATA_WORKER_CONCURRENCY": "x"}, "STRATA_WORKER_CONCURRENCY: invalid literal"),
        ({"STRATA_DISK_IO_THREADS": "0"}, "STRATA_DISK_IO_THREADS: must be greater than zero"),
        ({"STRATA_DISK_REUSE_SECONDS": "-1"}, "STRATA_DISK_REUSE_SECONDS: cannot be negative"),
    ],
)
def test_bad_values_name_the_option(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(environ={"STRATA_CONFIG_FILE": str(path)})
    path.write_text("host_byts: 1GiB\n")
    with pytest.raises(ConfigError, match="unknown option"):
        load_config(environ={"STRATA_CONFIG_FILE": str(path)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(environ={"STRATA_CONFIG_FILE": str(tmp_path / "missing.yaml")})


def test_disk_path_placeholders(monkeypatch):
    monkeypatch.setenv("STRATA_VAR_DIR", "/srv/strata")
    config = load_config(environ={"STRATA_NODE_NAME": "gpu-7"})
    assert config.node_disk_path == Path("/srv/strata/nodes/gpu-7/disk")


def test_the_disk_and_remote_tiers_have_their_own_io_threads():
    config = load_config(environ={"STRATA_DISK_IO_THREADS": "6", "STRATA_IO_THREADS": "3"})
    assert (config.disk_io_threads, config.io_threads) == (6, 3)
    assert load_config(environ={}).disk_io_threads == 4
    assert load_config(environ={"STRATA_DISK_REUSE_SECONDS": "0"}).disk_reuse_seconds == 0
    assert load_config(environ={}).disk_reuse_seconds == 10.0


def test_movement_and_native_copy_options_take_flag_over_env_over_yaml(tmp_path):
    config_file = tmp_path / "node.yaml"
    config_file.write_text("move_verify: header\nfault_hold_s: 7\nreconcile_grace_s: 9\nnative_copy: sse2\n")
    environ = {"STRATA_CONFIG_FILE": str(config_file), "STRATA_MOVE_VERIFY": "full", "STRATA_FAULT_HOLD_S": "8"}
    assert load_config(environ={"STRATA_CONFIG_FILE": str(config_file)}).move_verify == "header"
    config = load_config(overrides={"fault_hold_s": "1.5"}, environ=environ)
    assert (config.move_verify, config.fault_hold_s, config.reconcile_grace_s) == ("full", 1.5, 9.0)
    assert config.native_copy == "sse2" and config.fault_point == ""
    assert load_config(overrides={"move_verify": "header"}, environ=environ).move_verify == "header"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"STRATA_MOVE_VERIFY": "some"}, "STRATA_MOVE_VERIFY: expected one of full, header, got 'some'"),
        ({"STRATA_FAULT_POINT": "somewhere"}, "STRATA_FAULT_POINT: expected one of after-reserve, after-copy"),
        ({"STRATA_FAULT_HOLD_S": "-1"}, "STRATA_FAULT_HOLD_S: cannot be negative"),
        ({"STRATA_RECONCILE_GRACE_S": "soon"}, "STRATA_RECONCILE_GRACE_S: expected a number of seconds, got 'soon'"),
        ({"STRATA_NATIVE_COPY": "avx512"}, "STRATA_NATIVE_COPY: expected one of 1, 0, sse2, got 'avx512'"),
    ],
)
def test_bad_movement_and_native_copy_values_name_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_a_movement_option_from_yaml_is_refused_naming_the_file(tmp_path):
    config_file = tmp_path / "node.yaml"
    config_file.write_text("move_verify: sometimes\n")
    with pytest.raises(ConfigError, match=f"move_verify in {config_file}: expected one of full, header"):
        load_config(environ={"STRATA_CONFIG_FILE": str(config_file)})


def test_movement_options_come_from_the_node_configuration():
    from worker.movement_executor import MovementOptions  # noqa: PLC0415 - a Django module: the settings are loaded

    config = load_config(overrides={"move_verify": "header", "reconcile_grace_s": 5}, environ={})
    assert MovementOptions.from_config(config) == MovementOptions(verify="header", reconcile_grace_s=5.0)


def test_the_admin_key_may_come_from_a_file(tmp_path):
    key_file = tmp_path / "gpu-0.admin.key"
    key_file.write_text("issued-key-for-gpu-0\n")
    config = load_config(environ={"STRATA_NODE_ADMIN_KEY_FILE": str(key_file)})
    assert config.node_admin_key == "issued-key-for-gpu-0"
    assert load_config(environ={"STRATA_NODE_ADMIN_KEY": "plain"}).node_admin_key == "plain"


def test_a_bad_admin_key_file_is_named(tmp_path):
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=f"STRATA_NODE_ADMIN_KEY_FILE: {empty} is empty"):
        load_config(environ={"STRATA_NODE_ADMIN_KEY_FILE": str(empty)})
    missing = tmp_path / "missing.key"
    with pytest.raises(ConfigError, match=f"STRATA_NODE_ADMIN_KEY_FILE: cannot read {missing}: No such file"):
        load_config(environ={"STRATA_NODE_ADMIN_KEY_FILE": str(missing)})
    with pytest.raises(ConfigError, match="STRATA_NODE_ADMIN_KEY_FILE: set beside STRATA_NODE_ADMIN_KEY; set one"):
        load_config(environ={"STRATA_NODE_ADMIN_KEY_FILE": str(empty), "STRATA_NODE_ADMIN_KEY": "k"})
