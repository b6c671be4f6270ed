"""The run harness: what turns the method (kvt/*.py) into a command. Calibration text, kvt's own files,
the memory plan, the calibration a command runs (checkpoints, resume, several GPUs, the MLP's samples,
the attention-weighted option), tasks and their scoring, retention, the speed bench and run.py's
pipeline. It imports the method; the method never imports it."""
