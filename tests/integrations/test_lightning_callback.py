"""SafepointCallback inside a real Lightning Trainer, in this process: the SIGTERM race of Lightning 2.6
(a signal after this batch's save ended the job with code 0 and nothing saved), loggers hearing of a
checkpoint only once it is committed (Lightning #17915), DeepSpeed refused with a clear error, the
``pytorch_lightning`` import path, and a DataLoader whose position nothing reports being named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import safepoint

# lightning is imported inside each test (tests/integrations/lightning_parts.py): every xdist worker imports
# this module to collect it, and only the one that runs it should pay for the framework.

N = 40


def _loader(sampler: bool = True) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))
    if sampler:
        return DataLoader(data, batch_size=4, sampler=safepoint.ResumableSampler(N, seed=0))
    return DataLoader(data, batch_size=4, shuffle=True)


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "safepoint.json").exists())


def test_a_sigterm_after_the_batchs_save_still_saves_and_exits_143(root: Path) -> None:
    from tests.integrations.lightning_parts import Net, SafepointCallback, SigtermAt
    from tests.integrations.lightning_parts import trainer as _trainer

    # Lightning 2.6 alone: its handler flags the signal and raises SIGTERMException (exit code 0) at the
    # end of this batch, after the save of this batch was decided: nothing saved, the job "succeeded".
    killer = SigtermAt("on_train_batch_end", step=3)  # after SafepointCallback's maybe_save of step 3
    trainer = _trainer([SafepointCallback(str(root), save_every_steps=100), killer], steps=50)
    with pytest.raises(safepoint.Preempted) as caught:
        trainer.fit(Net(), _loader())
    assert caught.value.code == 143
    assert caught.value.saved_step == 4 and _committed(root) == [4]  # the next batch's end: nothing lost
    resumed = _trainer([SafepointCallback(str(root), save_every_steps=100)], steps=4)
    resumed.fit(Net(), _loader())
    assert resumed.global_step == 4  # resumed at step 4: nothing left to do


def test_a_sigterm_while_lightnings_own_handler_is_installed_exits_143(root: Path) -> None:
    from tests.integrations.lightning_parts import Net, SafepointCallback, SigtermAt
    from tests.integrations.lightning_parts import trainer as _trainer

    # Sent from on_train_start before SafepointCallback's: Lightning's handler (notifier + safepoint's) is the
    # one installed then; the notice still ends in an emergency save at the first batch's end.
    killer = SigtermAt("on_train_start")
    trainer = _trainer([killer, SafepointCallback(str(root), save_every_steps=100)], steps=50)
    with pytest.raises(safepoint.Preempted) as caught:
        trainer.fit(Net(), _loader())
    assert caught.value.code == 143 and _committed(root) == [1]


def test_loggers_hear_of_a_checkpoint_only_once_it_is_committed(root: Path) -> None:
    from tests.integrations.lightning_parts import Net, Recorder, SafepointCallback
    from tests.integrations.lightning_parts import trainer as _trainer

    recorder = Recorder()
    cb = SafepointCallback(str(root), save_every_steps=2, async_save=True)
    trainer = _trainer([cb], steps=7, logger=recorder)
    trainer.fit(Net(), _loader())
    assert recorder.seen == [(f"step-{s}", True) for s in (2, 4, 6, 7)]
    assert _committed(root) == [2, 4, 6, 7]


def test_deepspeed_is_refused_saying_why(root: Path) -> None:
    from tests.integrations.lightning_parts import DeepSpeedStrategy, Net, SafepointCallback

    # FSDP and ModelParallel go through DCP (test_lightning_ranks.py); DeepSpeed's ZeRO state cannot. The
    # package is not installed here, so its strategy cannot be constructed: an instance without __init__.
    trainer = SimpleNamespace(strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy))
    with pytest.raises(ValueError, match=r"DeepSpeedStrategy is not supported: .*ZeRO layout") as caught:
        SafepointCallback(str(root)).setup(trainer, Net(), "fit")
    assert "\n" not in str(caught.value)
    assert not root.exists()  # refused before the root is touched


def test_a_loader_without_a_reported_position_is_named(root: Path) -> None:
    from tests.integrations.lightning_parts import Net, SafepointCallback
    from tests.integrations.lightning_parts import trainer as _trainer

    trainer = _trainer([SafepointCallback(str(root), save_every_steps=100)], steps=2)
    with pytest.warns(
        UserWarning, match=r"sampler \(RandomSampler, num_workers=0\) does not report its position"
    ):
        trainer.fit(Net(), _loader(sampler=False))


@pytest.mark.slow  # a second framework import; the example's slow test covers this path too
def test_the_pytorch_lightning_package_resumes_the_whole_state(root: Path) -> None:
    import pytorch_lightning as pl

    from safepoint.integrations.lightning_pl import SafepointCallback as PLCallback
    from tests.integrations.lightning_parts import net_class as _net_class

    def fit(steps: int) -> tuple[pl.Trainer, Any]:
        model = _net_class(pl.LightningModule)()
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[PLCallback(str(root), save_every_steps=3)],
        )  # fmt: skip
        trainer.fit(model, _loader())
        return trainer, model

    first, _ = fit(5)
    second, model = fit(9)
    assert first.global_step == 5 and second.global_step == 9
    assert model.trainer.optimizers[0].state_dict()["state"]  # the optimizer came back with its moments
    assert _committed(root) == [3, 5, 6, 9]
    assert second.callbacks[-1].restored_step == 5  # type: ignore[attr-defined]


def test_an_object_store_root_with_a_local_tier(tmp_path: Path, moto_endpoint: str, bucket: str) -> None:
    """The callback's keywords are the manager's: an S3 root (moto) with a local tier; a restart on a node
    whose local disk is empty resumes from the durable copy."""
    from safepoint.remote.object_layout import RemoteLayout
    from tests.helpers.s3 import storage_options
    from tests.integrations.lightning_parts import L, Net, SafepointCallback
    from tests.integrations.lightning_parts import trainer as _trainer

    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)

    def fit(steps: int, local: Path) -> L.Trainer:
        cb = SafepointCallback(url, local_root=str(local), storage_options=opts, save_every_steps=2)
        trainer = _trainer([cb], steps=steps)
        trainer.fit(Net(), _loader())
        return trainer

    fit(4, tmp_path / "node-a")
    assert RemoteLayout(url, opts).committed_steps() == [2, 4]
    resumed = fit(6, tmp_path / "node-b")  # another node: nothing local
    assert resumed.callbacks[-1].restored_step == 4  # type: ignore[attr-defined]
    assert RemoteLayout(url, opts).committed_steps() == [2, 4, 6]
