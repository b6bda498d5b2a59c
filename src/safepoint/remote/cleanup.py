"""A new owner's cleanup of a root on an object store: finish replacements that were interrupted midway,
delete what uncommitted saves and uploads left (``RemoteLayout.clean_pending``).

It decides from one listing, and a listing can leave keys out: a store whose listings lag behind its
writes, a page cut short on the way. A step listed with its data but without its manifest looks exactly
like an interrupted save, and deleting it (manifest first, as ``discard`` does) would delete a committed
checkpoint because a LIST came back short. So before it deletes a step, or promotes a staged copy over
one, cleanup asks the manifest object itself (one HEAD, only for what it is about to remove: rare), and
leaves everything alone where the store cannot say.
"""

from __future__ import annotations

import logging
import posixpath
import re
from typing import Any

from safepoint.errors import CheckpointError
from safepoint.remote.confirmed import confirm
from safepoint.remote.upload import UploadError
from safepoint.store.guard import STEP_PATTERN
from safepoint.store.manifest import MANIFEST_NAME, Manifest
from safepoint.store.posix_layout import PENDING_DIR

log = logging.getLogger("safepoint")
_MANIFEST_KEY = re.compile(rf"^({STEP_PATTERN})/" + re.escape(MANIFEST_NAME) + "$")
_STEP_DIR = re.compile(rf"^({STEP_PATTERN})/")
_PENDING_STEP = re.compile(rf"^({STEP_PATTERN})-[0-9a-f]+$")


def clean_pending(layout: Any) -> list[str]:
    """Finish ``layout``'s (a RemoteLayout: not imported, which imports this module) interrupted
    replacements, delete its uncommitted data; what it did, one line each."""
    if layout.unguarded:
        return [f"not cleaning up {layout.root}: without a lease, uncommitted objects may be another job's"]
    done: list[str] = []
    store = layout.store
    layout.fence("cleaning up abandoned saves")
    objects = store.sizes(layout.base)
    committed = {m.group(1) for k in objects if (m := _MANIFEST_KEY.match(k))}
    staged = {k.split("/")[1] for k in objects if k.startswith(PENDING_DIR + "/") and k.count("/") >= 2}
    for name in sorted(staged):
        prefix = layout._p(PENDING_DIR, name)
        m = _PENDING_STEP.match(name)
        if m and m.group(1) not in committed and f"{PENDING_DIR}/{name}/{MANIFEST_NAME}" in objects:
            if (there := _manifest_there(layout, m.group(1))) is None:
                done.append(f"left {PENDING_DIR}/{name}: cannot tell yet whether {m.group(1)} is committed")
                continue
            if there:  # step N stands after all: this staged copy is an abandoned re-save (removed below)
                committed.add(m.group(1))
        if m and m.group(1) not in committed and f"{PENDING_DIR}/{name}/{MANIFEST_NAME}" in objects:
            try:
                manifest = Manifest.from_json(store.get_bytes(posixpath.join(prefix, MANIFEST_NAME)))
                confirm(store, prefix, manifest, prove=True)  # read once where unproven
                layout._promote(prefix, manifest)
                committed.add(m.group(1))
                done.append(f"finished the interrupted replacement of {m.group(1)}")
                continue
            except (CheckpointError, OSError) as e:
                if prefix in layout._unfinished:  # failed midway: the staged copy is all there is
                    done.append(f"could not finish replacing {m.group(1)} yet ({e}); will retry")
                    continue
                log.warning("safepoint: staged copy %s is unusable (%s); removing it", name, e)
        layout.discard(prefix)
        done.append(f"removed abandoned {PENDING_DIR}/{name}")
    dirs = {m.group(1) for k in objects if (m := _STEP_DIR.match(k))}
    for name in sorted(dirs - committed):
        if (there := _manifest_there(layout, name)) is not False:
            done.append(
                f"left {name}: " + ("committed after all" if there else "cannot tell yet if committed")
            )
            continue
        layout.discard(layout._p(name))
        done.append(f"removed uncommitted {name} (an interrupted save or upload)")
    try:
        if aborted := store.abort_uploads(layout.base):
            done.append(f"aborted {aborted} multipart upload(s) left open by an interrupted save/upload")
    except UploadError as e:
        log.warning("safepoint: could not abort unfinished multipart uploads under %s: %s", layout.root, e)
    return done


def _manifest_there(layout: Any, step_dir: str) -> bool | None:
    """Whether ``step_dir``'s manifest exists, asked of the object itself; None if the store cannot say."""
    try:
        layout.store.stored_checksum(layout._p(step_dir, MANIFEST_NAME))
    except FileNotFoundError:
        return False
    except (UploadError, OSError) as e:
        log.warning("safepoint: cannot tell whether %s is committed (%s); left alone", step_dir, e)
        return None
    log.warning(
        "safepoint: the listing of %s left out %s/%s, which exists", layout.root, step_dir, MANIFEST_NAME
    )
    return True
