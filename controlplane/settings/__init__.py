"""Settings: base.py plus one module per environment (dev, test, prod) and one per integration."""
