"""The step timeline: a trace recorder the pipeline engine writes spans to (`recorder.py`,
enabled by SMSHIM_TIMELINE) and the picture drawn from those traces (`plot.py`,
`smshim timeline TRACE_DIR`).

Imports the standard library (and matplotlib, only to draw).
"""
