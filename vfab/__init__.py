"""vfab: a layer-2 virtual-endpoint elastic services fabric (see DESIGN.md)."""

__version__ = "0.1.0"

import warnings

# os-ken imports eventlet, which warns at import time; vfab only uses eventlet
# inside the os-ken controller.
warnings.filterwarnings("ignore", message=r"\s*Eventlet is deprecated")
