//! A microVM assembled from a [`VmConfig`]: memory, the KVM VM with its in-kernel irqchip, the
//! legacy and virtio devices wired through irqfds and ioeventfds, the kernel loaded, and one
//! thread per vCPU. [`Machine::run`] returns how the VM ended.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::{mpsc, Arc};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::boot::layout::{SERIAL_IRQ, VIRTIO_IRQ_START, VIRTIO_MMIO_START};
use crate::boot::{self, BootEntry, BootError, BootSpec, MmioSlot};
use crate::bus::IoBus;
use crate::config::{ConfigError, VmConfig};
use crate::devices::legacy::{ConsoleLog, LegacyBus, SerialConsole};
use crate::devices::virtio::mmio::{MmioTransport, MMIO_WINDOW, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::VirtioDevice;
use crate::exit::VmExit;
use crate::vstate::memory::{self, GuestMemory};
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vm::Vm;
use crate::vstate::VstateError;

#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Vstate(#[from] VstateError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error("{what}: {source}")]
    Device { what: String, source: std::io::Error },
    #[error("virtio transport: {0}")]
    Transport(#[from] crate::devices::virtio::mmio::TransportError),
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("{0}")]
    Seccomp(String),
}

/// Each virtio device's transport with the base of its MMIO window.
type MmioDevices = Vec<(u64, MmioTransport)>;

pub struct Machine {
    vm: Vm,
    vcpus: Vec<Vcpu>,
    bus: Arc<IoBus>,
    console: ConsoleLog,
    entry: BootEntry,
    _memfd: File,
    /// The vsock socket file, removed when the VM ends (the devices are not torn down then).
    vsock_socket: Option<std::path::PathBuf>,
}

fn device_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> MachineError {
    let what = what.into();
    move |source| MachineError::Device { what, source }
}

/// The virtio devices of `cfg`, in the order their MMIO windows and IRQs are assigned.
fn virtio_devices(cfg: &VmConfig) -> Result<Vec<Box<dyn VirtioDevice>>, MachineError> {
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
    for d in &cfg.disks {
        let blk = crate::devices::virtio::block::Block::new(d.path.clone(), d.read_only)
            .map_err(device_error(format!("disk {}", d.path.display())))?;
        devices.push(Box::new(blk));
    }
    if let Some(v) = &cfg.vsock {
        let vsock = crate::devices::virtio::vsock::Vsock::new(v.guest_cid, v.uds_path.clone())
            .map_err(device_error(format!("vsock socket {}", v.uds_path.display())))?;
        devices.push(Box::new(vsock));
    }
    for f in &cfg.fs {
        let fs = crate::devices::virtio::fs::FsDevice::new(&f.tag, &f.socket)
            .map_err(std::io::Error::other)
            .map_err(device_error(format!("shared folder {:?}", f.tag)))?;
        devices.push(Box::new(fs));
    }
    if cfg.rng {
        let rng = crate::devices::virtio::rng::Rng::new().map_err(device_error("virtio-rng".to_string()))?;
        devices.push(Box::new(rng));
    }
    Ok(devices)
}

fn console(cfg: &VmConfig) -> Result<ConsoleLog, MachineError> {
    let file = match &cfg.console_log {
        Some(path) => File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(device_error(format!("console log {}", path.display())))?,
        None => File::from(std::io::stdout().as_fd().try_clone_to_owned().map_err(device_error("stdout"))?),
    };
    Ok(ConsoleLog::to_file(file))
}

impl Machine {
    pub fn build(cfg: &VmConfig) -> Result<Self, MachineError> {
        cfg.validate()?;
        let (mem, memfd) = memory::memfd_backed((cfg.memory_mib as usize) << 20)?;
        let vm = Vm::new(mem.clone())?;
        vm.setup_irqchip()?;

        let console = console(cfg)?;
        let serial_irq = EventFd::new(EFD_NONBLOCK).map_err(device_error("eventfd"))?;
        vm.register_irqfd(&serial_irq, SERIAL_IRQ)?;
        let legacy = LegacyBus::with_serial(SerialConsole::with_interrupt(console.clone(), serial_irq));

        let (mmio, slots) = Self::attach_virtio(&vm, &mem, virtio_devices(cfg)?)?;
        let spec = BootSpec {
            kernel: &cfg.kernel,
            initrd: cfg.initrd.as_deref(),
            cmdline: &cfg.cmdline,
            cpus: cfg.cpus,
            devices: &slots,
        };
        let entry = boot::load(&mem, &spec)?;

        let mut vcpus = Vec::with_capacity(cfg.cpus as usize);
        for id in 0..cfg.cpus {
            let vcpu = Vcpu::new(&vm, id, cfg.cpus)?;
            vcpu.configure_linux(&vm, entry)?;
            vcpus.push(vcpu);
        }
        let vsock_socket = cfg.vsock.as_ref().map(|v| v.uds_path.clone());
        Ok(Self { vm, vcpus, bus: Arc::new(IoBus::new(legacy, mmio)), console, entry, _memfd: memfd, vsock_socket })
    }

    /// Gives each device its MMIO window and IRQ, with the notify ioeventfds and the irqfd.
    fn attach_virtio(
        vm: &Vm,
        mem: &GuestMemory,
        devices: Vec<Box<dyn VirtioDevice>>,
    ) -> Result<(MmioDevices, Vec<MmioSlot>), MachineError> {
        let mut mmio = Vec::new();
        let mut slots = Vec::new();
        for (i, device) in devices.into_iter().enumerate() {
            let base = VIRTIO_MMIO_START + i as u64 * MMIO_WINDOW;
            let irq = VIRTIO_IRQ_START + i as u32;
            let transport = MmioTransport::new(device, mem.clone())?;
            vm.register_irqfd(transport.irq_evt(), irq)?;
            for (q, evt) in transport.queue_evts().iter().enumerate() {
                vm.register_mmio_ioeventfd(evt, base + QUEUE_NOTIFY_OFFSET, q as u32)?;
            }
            slots.push(MmioSlot { base, size: MMIO_WINDOW, irq });
            mmio.push((base, transport));
        }
        Ok((mmio, slots))
    }

    pub fn entry(&self) -> BootEntry {
        self.entry
    }

    pub fn console(&self) -> &ConsoleLog {
        &self.console
    }

    /// Runs every vCPU on its own thread until the first one stops, and says why. A reset
    /// after a kernel panic message is reported as a panic.
    pub fn run(self) -> Result<VmExit, MachineError> {
        let (tx, rx) = mpsc::channel();
        let mut handles = Vec::new();
        // No vCPU enters the guest before every thread, this one included, is filtered.
        let filtered = Arc::new(std::sync::Barrier::new(self.vcpus.len() + 1));
        for mut vcpu in self.vcpus {
            let bus = self.bus.clone();
            let tx = tx.clone();
            let filtered = filtered.clone();
            let handle = crate::seccomp::spawn_filtered(
                crate::seccomp::ThreadKind::Vcpu,
                &format!("vcpu{}", vcpu.id()),
                move || {
                    filtered.wait();
                    // A panic in a vCPU thread must end the VM with a status, not leave the
                    // other threads (or none) running: report it as an internal error.
                    let id = vcpu.id();
                    let exit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vcpu.run(&bus)))
                        .unwrap_or_else(|_| VmExit::Internal(format!("vCPU {id} thread panicked")));
                    let _ = tx.send(exit);
                },
            )
            .map_err(MachineError::Thread)?;
            handles.push(handle);
        }
        drop(tx);
        crate::seccomp::install(crate::seccomp::ThreadKind::Main).map_err(MachineError::Seccomp)?;
        filtered.wait();
        let exit = rx.recv().unwrap_or_else(|_| VmExit::Internal("every vCPU thread ended without an exit".into()));
        // The other vCPUs are still in KVM_RUN: the VM and its memory must stay mapped until the
        // caller ends the process, which stops them.
        std::mem::forget(self.vm);
        std::mem::forget(handles);
        // Nor are the devices torn down (their lanes joined, vhost-user told): the process is
        // about to end, and the main thread's filter allows none of that. The vsock socket file
        // is the one thing the teardown would have removed.
        std::mem::forget(self.bus);
        if let Some(path) = &self.vsock_socket {
            let _ = std::fs::remove_file(path);
        }
        Ok(match exit {
            VmExit::Reset if self.console.saw_panic() => VmExit::GuestPanic,
            other => other,
        })
    }
}
