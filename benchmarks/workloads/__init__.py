"""The workloads the suites and scripts send: sessions of prompts and their sizes (`sessions`),
sent to vLLM's OpenAI server (`vllm_api`) or to Strata's engine in-process (`engine`), all through
the one session driver of worker.workload, which the demo's workload runs on too."""
