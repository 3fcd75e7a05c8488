"""The engine half of serving: owns the model, its compiled programs and the decode loop (see ../__init__.py)."""
