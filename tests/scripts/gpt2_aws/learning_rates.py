"""Linear warmup, then linear decay to min_lr: the schedule shape of the GPT-2 example's
AnnealingLR (decay_style "linear"), with state_dict / load_state_dict for checkpoints."""

from __future__ import annotations


class AnnealingLR:
    def __init__(self, optimizer, start_lr: float, warmup_iter: float, total_iters: int,
                 min_lr: float = 0.0):
        self.optimizer = optimizer
        self.start_lr, self.warmup_iter = start_lr, warmup_iter
        self.total_iters, self.min_lr = total_iters, min_lr
        self.num_iters = 0
        self._apply()

    def get_lr(self) -> float:
        t = self.num_iters
        if self.warmup_iter > 0 and t <= self.warmup_iter:
            return self.start_lr * t / self.warmup_iter
        frac = min(1.0, (t - self.warmup_iter) / max(1e-9, self.total_iters - self.warmup_iter))
        return max(self.min_lr, self.start_lr * (1.0 - frac))

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.num_iters += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter,
                "total_iters": self.total_iters, "min_lr": self.min_lr,
                "num_iters": self.num_iters}

    def load_state_dict(self, sd: dict) -> None:
        self.__dict__.update({k: sd[k] for k in self.state_dict()})
        self._apply()
