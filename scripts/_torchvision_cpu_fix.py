"""Let a CUDA-built torchvision wheel import on a CPU-only torch.

torchvision's _C extension links libtorch_cuda/libc10_cuda, so on torch+cpu it fails to load
(torchvision tolerates that), but torchvision/_meta_registrations.py then calls
torch.library.register_fake("torchvision::nms"/"::qnms") unconditionally and raises
"operator torchvision::nms does not exist". This hook runs once, right before torchvision is
first imported: if _C cannot be loaded it defines the two op schemas (no kernels), so the
pure-Python parts (transforms, ...) import and work; the C++ ops stay unavailable as usual.
Installed through a .pth file; costs nothing until something imports torchvision.
"""
import importlib.util
import sys


class _TorchvisionCpuFix:
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec("torchvision")
            if spec is None or not spec.submodule_search_locations:
                return None
            import glob
            import os

            import torch

            libs = []
            for d in spec.submodule_search_locations:
                libs += glob.glob(os.path.join(d, "_C*.so"))
            try:
                for lib in libs:
                    torch.ops.load_library(lib)
                if libs:
                    return None  # real ops are there
            except (ImportError, OSError):
                pass
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            sys.modules[__name__]._library = lib  # keep the definitions alive
        except Exception:  # never break the import itself
            pass
        return None  # let the regular finders import torchvision


sys.meta_path.insert(0, _TorchvisionCpuFix())
