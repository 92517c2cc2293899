"""`smshim run` and its pieces: the command line (`cli.py`), a SageMaker estimator's
`distribution` dict and the SM_* environment (`sagemaker_env.py`), the static rendezvous for
several nodes (`rendezvous.py`, with the nodes' roll call in `multinode.py`), per-rank log
files and the short failure report (`worker_logs.py`), and the worker entry that runs the user's
script (`worker.py`).

Built on torchrun's launcher API. May import `smshim.runtime`, `smshim.timeline` and the
libraries' config resolvers (to check a job before any process starts); nothing in the libraries
imports the launcher.
"""
