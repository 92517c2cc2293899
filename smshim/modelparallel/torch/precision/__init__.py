"""Mixed precision: model casting and fp32 master weights (`mixed_precision.py`), loss scaling
(`loss_scaler.py`), and the caller's autocast state carried to the rank that runs a module
(`autocast_state.py`). `smp.amp` (the public GradScaler) is `..amp`.

May import the face's ground modules (`..errors`, `..state`, `..comm`) only.
"""
