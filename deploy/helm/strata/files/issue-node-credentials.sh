#!/bin/sh
# Issues the credential of each node in $NODES that has none yet and writes the Secret
# $SECRET_NAME (keys <node>.url, <node>.redis.url and <node>.admin.key per node, every node's) as a
# manifest for kubectl: $WORK_DIR/secret.json. Keys already in the Secret (mounted at
# $EXISTING_DIR) are kept as they are, so that a running node's password never changes under it; a
# node whose admin key is missing (issued before nodes had their own) gets the one its credential
# gives, unchanged.
set -eu
# The node group's grants name every table a node uses; a migration may have added one since the
# last credential was issued, so they are applied at every run (new credentials apply them too).
strata manage shell -c "from controlplane.directory.services.credentials import node_grants_apply; node_grants_apply()"
mkdir -p "$WORK_DIR/urls"
new=""
keyless=""
for node in $NODES; do
    # A node issued before nodes had Redis users has no <node>.redis.url: it gets both anew.
    if [ -s "$EXISTING_DIR/$node.url" ] && [ -s "$EXISTING_DIR/$node.redis.url" ]; then
        cp "$EXISTING_DIR/$node.url" "$WORK_DIR/urls/$node.url"
        cp "$EXISTING_DIR/$node.redis.url" "$WORK_DIR/urls/$node.redis.url"
        if [ -s "$EXISTING_DIR/$node.admin.key" ]; then
            cp "$EXISTING_DIR/$node.admin.key" "$WORK_DIR/urls/$node.admin.key"
        else
            keyless="$keyless $node"
        fi
    else
        new="$new $node"
    fi
done
if [ -n "$new" ]; then
    # shellcheck disable=SC2086 # one argument per node
    strata credential $new --url-dir "$WORK_DIR/urls"
fi
if [ -n "$keyless" ]; then
    # shellcheck disable=SC2086 # one argument per node
    strata credential $keyless --admin-key --url-dir "$WORK_DIR/urls"
fi
python - <<'PY'
import base64
import json
import os
from pathlib import Path

work = Path(os.environ["WORK_DIR"])
data = {
    path.name: base64.b64encode(path.read_bytes()).decode()
    for path in sorted([*(work / "urls").glob("*.url"), *(work / "urls").glob("*.admin.key")])
}
secret = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {
        "name": os.environ["SECRET_NAME"],
        "namespace": os.environ["SECRET_NAMESPACE"],
        "labels": {"app.kubernetes.io/component": "node-credentials"},
    },
    "type": "Opaque",
    "data": data,
}
(work / "secret.json").write_text(json.dumps(secret, indent=2))
print(f"{os.environ['SECRET_NAME']}: {', '.join(sorted(data))}")
PY
