"""StrataConnector: vLLM's KV connector (v1) backed by Strata's tiers, directory and offload manager.

vLLM loads the connector class by module path and name: `StrataConnectorBase` from this package
(the node's tiers alone), or `worker.vllm_connector.StrataConnector` (with the fleet's
directory). vLLM runs the connector twice, in two processes, and each module holds one part:

    connector.py        StrataConnectorBase: vLLM's hooks, each guarded, handed to the half of
                        the role the process runs
    scheduler_half.py   the scheduler's half: each request's load-or-recompute answer, each step's
                        loads and saves, the request timelines
    lookups.py          the scheduler half's lookups, never waiting on the database
    worker_half.py      the worker's half: layer-wise loads into vLLM's pages, saves from them
                        into the write-back tier, load errors, the step's measurements
    failed_pages.py     the pages failed loads left, and the saves they poison
    sharding.py         tensor parallel: a rank's kv heads of a block, the gather of the
                        ranks' shares to the first rank, which stores the block
    metadata.py         what the halves send each other every step (pickled)
    runtime.py          what a half opens (options, profile, tiers, directory, manager) and the
                        checks of vLLM's settings

Every hook is guarded: an error inside Strata (database or Redis down, a bug) becomes a miss and
a log line, never an exception in vLLM's engine loop. The engine must run with
kv_load_failure_policy "recompute" (a failed load is recomputed, never served, never fatal) and
one pipeline-parallel stage; tensor-parallel ranks each move their own kv heads of the model's
blocks (`sharding`).

The options are the node's (`dataplane.config`): STRATA_* variables, STRATA_CONFIG_FILE, and the
connector's kv_connector_extra_config, whose keys are option names and take precedence. The
package knows no Django: the directory comes from `open_directory`, which the control plane's
subclass (`worker.vllm_connector.StrataConnector`) provides.
"""

from worker.dataplane.connectors.vllm.connector import StrataConnectorBase

__all__ = ["StrataConnectorBase"]
