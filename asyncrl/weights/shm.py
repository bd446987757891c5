"""Same-host weight broadcast through shared memory, announced over ZeroMQ.

The learner writes each bucket once into its own file under ``/dev/shm`` (a tmpfs: pages of
RAM, no disk), in a directory per version that is renamed into place when complete, so a
subscriber never sees half a version. It then announces ``{policy_version, dir, buckets:
[{file, nbytes, crc, tensors: [[name, dtype, shape, offset, nbytes]...]}], ack}`` on a PUB
socket, and repeats the newest announcement every second (a PUB drops what was sent before a
subscriber joined). Each subscriber maps the files (``mmap``, shared and read-only: torch
views, no copy) and hands out views once every bucket's checksum is checked: the data is written
once whatever the number of subscribers, which is why the time stays flat as they grow. It keeps
its mapping of each file while recent versions use it (``asyncrl.weights.mappings``): a recycled
file (below) is read again without page faults.

The bytes are one copy on the host, so each bucket is checked once per host, not once per
subscriber (N subscribers reading every byte would make the time grow with N): whichever
subscriber locks the bucket's verdict file first checks it and writes the verdict for the others
(``asyncrl.weights.shm_check``).

To overlap the subscribers' checks with the writing, each bucket is also announced as soon as it
is written and summed (``{policy_version, part, dir, bucket}``, pointing into the version's
temporary directory): a subscriber's checker thread maps and checks it then, and once the
version is announced whole it maps only the buckets it has not seen (a mapping survives the
rename). ``newest`` hands out versions already verified, so the checks run while a generator
samples, off its critical path.

Unlinking: each subscriber acks a version (PUSH to the learner's PULL, address in the
announcement) once its engine has copied the tensors in, or reports the error. A superseded
version is removed once every subscriber that has ever acked has acked it or a newer one, or
``keep_s`` seconds after it was superseded, and in any case when more than ``max_versions``
exist. A version every subscriber acked is not unlinked but recycled: its files take the next
version (their tmpfs pages are already allocated, which makes writing ~2x faster). A mapping
survives the unlink (Linux keeps the pages until the last ``munmap``), so
removal only races a subscriber that has not opened the files yet; it then gets a
``WeightSyncError`` naming the missing version and takes the next one.

| socket | blocks | dropped |
| --- | --- | --- |
| announcements PUB -> SUB | never | everything before a subscriber joins (hence the repeats) |
| acks PUSH -> PULL | a subscriber's ack waits up to 1 s for the learner, then is dropped (logged) | nothing else |

The parts: ``shm_publisher`` (the learner's side), ``shm_subscriber`` (the generators'),
``shm_check`` (the once-per-host check); every name is still imported from here.
"""

from asyncrl.weights.shm_check import CHECK_WAIT_S as CHECK_WAIT_S
from asyncrl.weights.shm_check import SharedCheck as SharedCheck
from asyncrl.weights.shm_publisher import SHM_ROOT as SHM_ROOT
from asyncrl.weights.shm_publisher import ShmWeightPublisher as ShmWeightPublisher
from asyncrl.weights.shm_publisher import remove_stale as remove_stale
from asyncrl.weights.shm_subscriber import ShmWeightSubscriber as ShmWeightSubscriber
