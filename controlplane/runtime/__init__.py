"""Process-level runtime of the control plane: environment, embedded services, the demo supervisor."""
