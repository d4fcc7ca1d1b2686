#!/usr/bin/env bash
# lavapipe (Mesa's Vulkan driver on the CPU), the Vulkan loader and the Khronos
# validation layer, from Debian's packages, when they are missing. `cargo xtask ci`
# runs this before the Vulkan row of the conformance suite.
set -euo pipefail
have() {
  # grep reads everything (no -q): under pipefail an early exit would fail ldconfig with SIGPIPE.
  ldconfig -p | grep 'libvulkan.so.1' >/dev/null \
    && ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 \
    && ls /usr/share/vulkan/explicit_layer.d/VkLayer_khronos_validation.json >/dev/null 2>&1
}
if have; then echo "vulkan: lavapipe, the loader and the validation layer are installed"; exit 0; fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
PKGS="mesa-vulkan-drivers libvulkan1 vulkan-validationlayers"
install() { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $PKGS; }
install || { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && install; }
have || { echo "vulkan: $PKGS installed, but lavapipe, the loader or the validation layer is still missing" >&2; exit 1; }
echo "vulkan: installed $PKGS"
