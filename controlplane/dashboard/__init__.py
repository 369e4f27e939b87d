"""The operator dashboard: pages and the live websocket stream."""
