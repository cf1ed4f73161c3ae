# Sourced by scripts/image/build.sh, and read by the tests (tests/image_service.py): how buildah and podman run
# Fleet's image here. Storage: the user's default store (root's is /var/lib/containers/storage) with the overlay
# driver, so each container shares the image's layers instead of copying its root file system (vfs does: several
# GB for this image). vfs only where the kernel has no overlay, or when FLEET_IMAGE_STORAGE_DRIVER=vfs says so (a
# store made with one driver cannot be opened with the other: `podman system reset` empties it).
image_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$image_dir/containers.conf}"
if [ -n "${FLEET_IMAGE_STORAGE_DRIVER:-}" ]; then
  export STORAGE_DRIVER="$FLEET_IMAGE_STORAGE_DRIVER"
elif grep -qw overlay /proc/filesystems 2>/dev/null; then
  export STORAGE_DRIVER=overlay
else
  export STORAGE_DRIVER=vfs
fi
export BUILDAH_ISOLATION=chroot
