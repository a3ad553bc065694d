"""Moving pages between tier buffers: batched copy engines, a Triton kernel, or plain CPU copies.

``PageCopier(device).copy(src, dst, pairs, page_bytes, stream)`` moves a batch of pages and returns
the path it took; ``CopyPolicy`` decides between the copy engines and the kernel from the page
size and the host link (docs/copy.md). Importing this package needs only torch and numpy: Triton
and cuda-bindings are imported by the first call that uses them.
"""

from kvtier.copy.copier import PageCopier
from kvtier.copy.link import LinkInfo, detect_link
from kvtier.copy.policy import CopyPath, CopyPolicy, DevicePath

__all__ = ["CopyPath", "CopyPolicy", "DevicePath", "LinkInfo", "PageCopier", "detect_link"]
