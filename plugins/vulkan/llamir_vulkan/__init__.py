"""llamir's Vulkan backend: GLSL compute shaders compiled by glslc, run through the `vulkan`
(cffi) package on any Vulkan 1.2 device, Mesa's lavapipe included.

    pip install -e plugins/vulkan          # with libvulkan1, a driver and glslc installed
    llamir backends                        # lists vulkan and its devices (or why not usable)
    llamir test-backend-ops -b vulkan
    llamir run MODEL --device vulkan -ngl 99 --temp 0

LLAMIR_VULKAN_VALIDATE=1 runs under the Khronos validation layer and collects its messages
(`validation_messages()`); LLAMIR_VULKAN_STAGING=1 keeps device memory unmapped, so every
host transfer goes through a staging buffer as on a discrete GPU. docs/vulkan.md has the rest.
"""

from __future__ import annotations

from llamir.backends import Backend, BackendReg, Device, DeviceType, Option


class VulkanReg(BackendReg):
    """The Vulkan devices of this machine. Nothing is loaded until the devices are asked for;
    a machine without a loader, a driver or glslc gets one device that says why it is not usable."""

    name = "vulkan"
    description = "Vulkan compute shaders (GLSL via glslc) through the vulkan package"
    options = {"offload": Option("offload_batch", int, "op_offload batch threshold (default 32)")}

    def __init__(self):
        self._devices: list[Device] | None = None

    def devices(self) -> list[Device]:
        if self._devices is None:
            self._devices = _discover()
        return list(self._devices)

    def init_backend(self, device: Device, **options) -> Backend:
        from llamir_vulkan.backend import VulkanBackend

        return VulkanBackend(device, **options)


def _discover() -> list[Device]:
    from llamir_vulkan.backend import VulkanDevice, describe_error
    from llamir_vulkan.runtime import Instance
    from llamir_vulkan.shaders import find_glslc

    try:
        instance = Instance.shared()
    except Exception as err:  # no loader, no driver, no package: one device saying so
        return [Device("vulkan0", DeviceType.GPU, 0, "no Vulkan device", unusable=describe_error(err))]
    if not instance.physical:
        return [Device("vulkan0", DeviceType.GPU, 0, "no Vulkan device",
                       unusable="the Vulkan loader found no physical device (install a driver, e.g. "
                                "mesa-vulkan-drivers)")]
    try:
        find_glslc()
        no_compiler = None
    except Exception as err:
        no_compiler = describe_error(err)
    return [VulkanDevice(i, info, instance, unusable=no_compiler) for i, info in enumerate(instance.physical)]


def validation_messages() -> list[str]:
    """What the validation layer reported so far in this process (LLAMIR_VULKAN_VALIDATE=1)."""
    from llamir_vulkan.runtime import Instance

    return list(Instance._shared.messages) if Instance._shared is not None else []


__all__ = ["VulkanReg", "validation_messages"]
