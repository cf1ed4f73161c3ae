# Sourced by scripts/image/build.sh (the tests set the same variables: tests/image_service.py): how buildah and
# podman run Fleet's image here. Storage: root's default store (/var/lib/containers/storage) with the overlay
# driver, so each container shares the image's layers instead of copying its root file system (vfs does, several
# GB for this image); FLEET_IMAGE_STORAGE_DRIVER=vfs where the kernel or the file system has no overlay.
image_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$image_dir/containers.conf}"
export STORAGE_DRIVER="${FLEET_IMAGE_STORAGE_DRIVER:-overlay}"
export BUILDAH_ISOLATION=chroot
