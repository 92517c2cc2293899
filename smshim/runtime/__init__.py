"""Process-level runtime pieces every smshim library shares (launch detection, CPU mode).

May import torch and smshim's communication helpers; never the smp/smddp API packages.
Kept free of imports here: `smshim.runtime.cpu_mode` is imported at interpreter start-up.
"""
