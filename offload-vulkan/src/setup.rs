//! Choosing what a Vulkan backend runs on: the instance (with the validation
//! layer where asked), the physical device and its queue families, where copies
//! go, and whether host pages can be imported.

use crate::context::{debug_callback, vk_err, CopyQueue, HostAllocation, VulkanBackend, VulkanOptions, BACKEND};
use ash::vk;
use offload_core::{Error, Result};
use std::ffi::{c_void, CStr, CString};
use std::sync::Mutex;

/// A queue as (family, index in it), or `None` for another one the caller names.
pub(crate) type QueueAt = Option<(u32, u32)>;

impl VulkanBackend {
    /// Where copies go, as (family, queue index): the copy queue (`None`: the
    /// compute queue) and the split copies' second queue (the transfer family's
    /// second queue where it has one; `None`: the copy queue itself).
    pub(crate) fn copy_queues(
        options: &VulkanOptions,
        compute_family: u32,
        transfer: Option<(u32, u32)>,
        compute_queues: u32,
    ) -> (QueueAt, QueueAt) {
        // Where copies go: (family, queue index), or None for the compute queue.
        let transfer_family = transfer.map(|(t, _)| t);
        let copy_at = match (options.copy_queue, transfer_family) {
            (CopyQueue::Transfer, Some(t)) => Some((t, 0)),
            (CopyQueue::Transfer | CopyQueue::SecondCompute, _) if compute_queues >= 2 => Some((compute_family, 1)),
            _ => None,
        };
        // Split copies' second queue: the transfer family's second queue where it
        // has one; else the copy queue itself (`None` here).
        let second_at = match (options.split_copies, copy_at, transfer) {
            (true, Some((t, 0)), Some((tf, n))) if t == tf && n >= 2 => Some((t, 1)),
            _ => None,
        };
        (copy_at, second_at)
    }

    /// The Vulkan instance, with the validation layer and its messenger (writing
    /// into `messages`) where `options.validation` asks for them.
    #[allow(clippy::type_complexity)]
    pub(crate) fn create_instance(
        entry: &ash::Entry,
        options: &VulkanOptions,
        messages: *mut Mutex<Vec<String>>,
    ) -> Result<(ash::Instance, Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>)> {
        let layer = c"VK_LAYER_KHRONOS_validation";
        let mut layers = Vec::new();
        let mut extensions = Vec::new();
        if options.validation {
            // SAFETY: a query with no handles involved.
            let have = unsafe { entry.enumerate_instance_layer_properties() }
                .map_err(|e| vk_err("vkEnumerateInstanceLayerProperties", "validation", e))?;
            if !have.iter().any(|l| l.layer_name_as_c_str().is_ok_and(|n| n == layer)) {
                // Not `Unsupported`: the device may be there, and a test that read this as
                // "no Vulkan device" would skip every row on a machine missing one package.
                return Err(Error::device(
                    BACKEND,
                    "enabling validation",
                    "the Khronos validation layer is not installed (Debian: vulkan-validationlayers); or set VulkanOptions::validation to false",
                ));
            }
            layers.push(layer.as_ptr());
            extensions.push(ash::ext::debug_utils::NAME.as_ptr());
        }
        let app_name = CString::new("offload").unwrap_or_default();
        let app = vk::ApplicationInfo::default().application_name(&app_name).api_version(vk::API_VERSION_1_2);
        let ci = vk::InstanceCreateInfo::default().application_info(&app).enabled_layer_names(&layers).enabled_extension_names(&extensions);
        // SAFETY: the create info and everything it points to live across the call.
        let instance = unsafe { entry.create_instance(&ci, None) }.map_err(|e| match e {
            vk::Result::ERROR_INCOMPATIBLE_DRIVER | vk::Result::ERROR_INITIALIZATION_FAILED => {
                Error::unsupported(BACKEND, format!("no Vulkan driver ({e})"))
            }
            e => vk_err("vkCreateInstance", "the instance", e),
        })?;
        let mut debug = None;
        if options.validation {
            let du = ash::ext::debug_utils::Instance::new(entry, &instance);
            let info = vk::DebugUtilsMessengerCreateInfoEXT::default()
                .message_severity(vk::DebugUtilsMessageSeverityFlagsEXT::ERROR | vk::DebugUtilsMessageSeverityFlagsEXT::WARNING)
                .message_type(vk::DebugUtilsMessageTypeFlagsEXT::VALIDATION | vk::DebugUtilsMessageTypeFlagsEXT::GENERAL)
                .pfn_user_callback(Some(debug_callback))
                .user_data(messages as *mut c_void);
            // SAFETY: the callback and its user data outlive the messenger (destroyed in `Drop`).
            match unsafe { du.create_debug_utils_messenger(&info, None) } {
                Ok(m) => debug = Some((du, m)),
                Err(e) => {
                    // SAFETY: nothing was created from the instance yet.
                    unsafe { instance.destroy_instance(None) };
                    return Err(vk_err("vkCreateDebugUtilsMessengerEXT", "validation messages", e));
                }
            }
        }
        Ok((instance, debug))
    }

    /// The alignment an imported host pointer (and its size) needs where host
    /// pages are to be imported (`HostAllocation::Imported`) and the device offers
    /// it for transfer buffers; `None` where they are allocated by the driver.
    pub(crate) fn import_alignment(
        instance: &ash::Instance,
        phys: vk::PhysicalDevice,
        options: &VulkanOptions,
        name: &str,
    ) -> Option<usize> {
        match options.host_memory {
            HostAllocation::Allocated => None,
            HostAllocation::Imported => {
                // SAFETY: queries of a live physical device.
                let offered = match unsafe { instance.enumerate_device_extension_properties(phys) } {
                    Ok(exts) => exts.iter().any(|e| e.extension_name_as_c_str() == Ok(ash::ext::external_memory_host::NAME)),
                    Err(e) => {
                        tracing::warn!("{name}: vkEnumerateDeviceExtensionProperties failed ({e}); host memory not imported");
                        false
                    }
                };
                // Importable into a transfer-source buffer, and not only as a dedicated allocation.
                let host = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;
                let info = vk::PhysicalDeviceExternalBufferInfo::default().usage(vk::BufferUsageFlags::TRANSFER_SRC).handle_type(host);
                let mut ext_props = vk::ExternalBufferProperties::default();
                if offered {
                    // SAFETY: as above; `ext_props` outlives the call.
                    unsafe { instance.get_physical_device_external_buffer_properties(phys, &info, &mut ext_props) };
                }
                let f = ext_props.external_memory_properties.external_memory_features;
                let importable =
                    f.contains(vk::ExternalMemoryFeatureFlags::IMPORTABLE) && !f.contains(vk::ExternalMemoryFeatureFlags::DEDICATED_ONLY);
                if offered && importable {
                    let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
                    let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut host);
                    // SAFETY: as above; `host` outlives the call.
                    unsafe { instance.get_physical_device_properties2(phys, &mut props) };
                    Some((host.min_imported_host_pointer_alignment as usize).max(4096))
                } else {
                    tracing::warn!(
                        "{name}: host pages not importable into a transfer buffer (VK_EXT_external_memory_host offered: {offered}, features {f:?}); host buffers are allocated by the driver"
                    );
                    None
                }
            }
        }
    }

    /// The physical device, its compute family, a dedicated transfer family with
    /// its queue count, and the compute family's queue count.
    #[allow(clippy::type_complexity)]
    pub(crate) fn open_device(
        instance: &ash::Instance,
        options: &VulkanOptions,
    ) -> Result<(vk::PhysicalDevice, u32, Option<(u32, u32)>, u32, String)> {
        // SAFETY: queries of a live instance.
        let devices = unsafe { instance.enumerate_physical_devices() }.map_err(|e| vk_err("vkEnumeratePhysicalDevices", "devices", e))?;
        let mut with_compute = Vec::new();
        for pd in devices {
            // SAFETY: as above.
            let (props, families) =
                unsafe { (instance.get_physical_device_properties(pd), instance.get_physical_device_queue_family_properties(pd)) };
            if props.api_version < vk::API_VERSION_1_2 {
                continue;
            }
            let Some(c) = families.iter().position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE)) else { continue };
            let t = families.iter().position(|f| {
                f.queue_flags.contains(vk::QueueFlags::TRANSFER)
                    && !f.queue_flags.intersects(vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS)
            });
            let name = props.device_name_as_c_str().map(CStr::to_string_lossy).map(|n| n.into_owned()).unwrap_or_default();
            let t = t.map(|t| (t as u32, families[t].queue_count));
            with_compute.push((pd, c as u32, t, families[c].queue_count, name));
        }
        let n = with_compute.len();
        with_compute.into_iter().nth(options.device_index).ok_or_else(|| {
            Error::unsupported(BACKEND, format!("no Vulkan 1.2 device with a compute queue at index {} ({n} found)", options.device_index))
        })
    }
}
