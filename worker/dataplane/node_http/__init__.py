"""What both node HTTP servers answer alike (Strata's engine server in `serving` and the status
server beside vLLM in `connectors`): who may read the operator endpoints (access.py) and the
request timelines (timelines.py). Below both servers, importing neither, so the rules are one."""
