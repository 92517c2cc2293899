"""`smshim run` and its pieces: the command line (`cli.py`), a SageMaker estimator's
`distribution` dict and the SM_* environment (`sagemaker_env.py`), the static rendezvous for
several nodes (`rendezvous.py`), and the worker entry that runs the user's script (`worker.py`).

Built on torchrun's launcher API. May import `smshim.runtime` and `smshim.timeline`; nothing in
the libraries imports the launcher.
"""
