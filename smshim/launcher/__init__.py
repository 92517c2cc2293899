"""`smshim run`: the launcher (argument handling, SageMaker job environment, rendezvous, worker
logs). May import torch's launcher/elastic API and smshim.runtime; nothing imports it back.
"""
