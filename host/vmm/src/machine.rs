//! A microVM assembled from a [`VmConfig`]: memory, the KVM VM with its in-kernel irqchip, the
//! legacy and virtio devices wired through irqfds and ioeventfds, the kernel loaded, and one
//! thread per vCPU. [`Machine::run`] returns how the VM ended.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use kvm_ioctls::Kvm;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::boot::layout::{SERIAL_IRQ, VIRTIO_IRQ_START, VIRTIO_MMIO_START};
use crate::boot::{self, BootEntry, BootError, BootSpec, MmioSlot};
use crate::bus::IoBus;
use crate::config::{ConfigError, VmConfig};
use crate::devices::legacy::{ConsoleLog, LegacyBus, SerialConsole, SerialSnapshot};
use crate::devices::virtio::block::disk::Disk;
use crate::devices::virtio::mmio::{MmioTransport, TransportState, MMIO_WINDOW, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::vsock::unix_backend::HostListener;
use crate::devices::virtio::VirtioDevice;
use crate::exit::VmExit;
use crate::vstate::memory::{self, GuestMemory};
use crate::vstate::vcpu::{Run, Vcpu};
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
    #[error("snapshot: {0}")]
    Snapshot(String),
    #[error("snapshot: {0}")]
    Serial(#[from] crate::devices::legacy::SerialRestoreError),
}

/// Each virtio device's transport with the base of its MMIO window.
type MmioDevices = Vec<(u64, MmioTransport)>;

pub struct Machine {
    vm: Vm,
    vcpus: Vec<Vcpu>,
    bus: Arc<IoBus>,
    console: ConsoleLog,
    /// The memfd behind guest memory, when a vhost-user backend maps it too.
    _memfd: Option<File>,
    /// The vsock socket file, removed when the VM ends (the devices are not torn down then).
    vsock_socket: Option<PathBuf>,
    control: Option<UnixListener>,
    memory_size: u64,
    /// Where a restore's time went, printed when its vCPUs go.
    restored: Option<RestorePhases>,
    /// When the process started, for that line.
    launched: Option<Instant>,
}

/// Milliseconds of each phase of [`Machine::restore`]: what `vmctl bench vmm` sets beside
/// Firecracker's restore.
#[derive(Debug, Clone, Copy, Default)]
pub struct RestorePhases {
    /// Reading the state file, checking its digest and parsing it.
    pub state: u64,
    /// Mapping (or, with shared folders, copying) guest memory, prefaulting included.
    pub memory: u64,
    /// The VM, its interrupt controllers and the vCPUs.
    pub vcpus: u64,
    /// The devices, on their new host resources.
    pub devices: u64,
    /// Starting the vCPU and device threads, each under its filter, until the vCPUs go.
    pub threads: u64,
}

impl std::fmt::Display for RestorePhases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "state {} ms, memory {} ms, vcpus {} ms, devices {} ms, threads {} ms",
            self.state, self.memory, self.vcpus, self.devices, self.threads
        )
    }
}

/// A snapshot opened for [`Machine::restore`].
struct OpenedSnapshot {
    state: crate::snapshot::SnapshotState,
    memory: File,
    path: PathBuf,
    prefault: bool,
    load_ms: u64,
}

fn device_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> MachineError {
    let what = what.into();
    move |source| MachineError::Device { what, source }
}

/// Everything of the host a VM uses, opened up front: `/dev/kvm`, kernel and initrd, the
/// disks, the console log, the vsock listener and the connections to virtiofsd. umbra-vmm
/// opens it all, then enters its jail ([`crate::jail`]), where none of these paths exist.
pub struct HostFiles {
    kvm: Kvm,
    kernel: File,
    initrd: Option<File>,
    disks: Vec<Disk>,
    console: File,
    /// The bound listener and the path the VMM knows it by (see [`HostFiles::rebase`]).
    vsock: Option<(UnixListener, PathBuf)>,
    fs: Vec<UnixStream>,
    /// The control socket, bound before the jail (see [`crate::control`]).
    control: Option<UnixListener>,
    /// A snapshot to restore: its state, read and checked, and its memory file.
    snapshot: Option<OpenedSnapshot>,
}

impl HostFiles {
    pub fn open(cfg: &VmConfig) -> Result<Self, MachineError> {
        crate::config::validate(cfg)?;
        let kvm = Kvm::new().map_err(VstateError::Kvm)?;
        let kernel = boot::open("kernel", &cfg.kernel)?;
        let initrd = cfg.initrd.as_deref().map(|path| boot::open("initrd", path)).transpose()?;
        let mut disks = Vec::new();
        for d in &cfg.disks {
            disks.push(Disk::open(&d.path, d.read_only).map_err(device_error(format!("disk {}", d.path.display())))?);
        }
        let console = match &cfg.console_log {
            Some(path) => File::options()
                .create(true)
                .append(true)
                .open(path)
                .map_err(device_error(format!("console log {}", path.display())))?,
            None => File::from(std::io::stdout().as_fd().try_clone_to_owned().map_err(device_error("stdout"))?),
        };
        let vsock = match &cfg.vsock {
            Some(v) => {
                let listener = UnixListener::bind(&v.uds_path)
                    .map_err(device_error(format!("cannot bind the vsock socket {}", v.uds_path.display())))?;
                Some((listener, v.uds_path.clone()))
            }
            None => None,
        };
        let mut fs = Vec::new();
        for f in &cfg.fs {
            fs.push(
                crate::devices::virtio::fs::backend::connect(&f.socket)
                    .map_err(std::io::Error::other)
                    .map_err(device_error(format!("shared folder {:?}", f.tag)))?,
            );
        }
        let control = match &cfg.control {
            Some(path) => Some(
                UnixListener::bind(path)
                    .map_err(device_error(format!("cannot bind the control socket {}", path.display())))?,
            ),
            None => None,
        };
        Ok(Self { kvm, kernel, initrd, disks, console, vsock, fs, control, snapshot: None })
    }

    /// Also opens the snapshot in `dir` (its `state`, read and checked now, and its `memory`),
    /// for [`Machine::restore`]. With `prefault`, the memory file's data is mapped in up front
    /// (see [`crate::snapshot::memory::map_private_file`]); without it, as the guest touches it.
    pub fn with_snapshot(mut self, dir: &Path, prefault: bool) -> Result<Self, MachineError> {
        let snapshot_error = |e: crate::snapshot::SnapshotError| MachineError::Snapshot(e.to_string());
        let started = Instant::now();
        let state = crate::snapshot::file::load(&dir.join("state")).map_err(snapshot_error)?;
        let path = dir.join("memory");
        let memory = File::open(&path).map_err(device_error(format!("the memory file {}", path.display())))?;
        let load_ms = started.elapsed().as_millis() as u64;
        self.snapshot = Some(OpenedSnapshot { state, memory, path, prefault, load_ms });
        Ok(self)
    }

    /// From now on the vsock socket is known by its path inside the jail rooted at `dir`,
    /// where the `<socket>_<port>` sockets of host services are looked up.
    pub fn rebase(&mut self, dir: &Path) -> Result<(), MachineError> {
        if let Some((_, path)) = &mut self.vsock {
            let inside = path.strip_prefix(dir).map_err(|_| {
                MachineError::Config(ConfigError::Invalid(format!(
                    "the vsock socket {} is not inside the jail {}",
                    path.display(),
                    dir.display()
                )))
            })?;
            *path = Path::new("/").join(inside);
        }
        Ok(())
    }

    /// The vsock socket's path as the VMM knows it.
    pub fn vsock_path(&self) -> Option<&Path> {
        self.vsock.as_ref().map(|(_, p)| p.as_path())
    }
}

/// The virtio devices of `cfg` over `files`, in the order their MMIO windows and IRQs are
/// assigned.
fn virtio_devices(
    cfg: &VmConfig,
    disks: Vec<Disk>,
    vsock: Option<(UnixListener, PathBuf)>,
    fs: Vec<UnixStream>,
) -> Result<Vec<Box<dyn VirtioDevice>>, MachineError> {
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
    for (d, disk) in cfg.disks.iter().zip(disks) {
        let blk = crate::devices::virtio::block::Block::with_disk(disk)
            .map_err(device_error(format!("disk {}", d.path.display())))?;
        devices.push(Box::new(blk));
    }
    if let (Some(v), Some((listener, path))) = (&cfg.vsock, vsock) {
        let listener = HostListener::from_std(listener, path)
            .and_then(|l| crate::devices::virtio::vsock::Vsock::with_listener(v.guest_cid, l))
            .map_err(device_error(format!("vsock socket {}", v.uds_path.display())))?;
        devices.push(Box::new(listener));
    }
    for (f, stream) in cfg.fs.iter().zip(fs) {
        let fs = crate::devices::virtio::fs::FsDevice::with_stream(&f.tag, &f.socket, stream)
            .map_err(std::io::Error::other)
            .map_err(device_error(format!("shared folder {:?}", f.tag)))?;
        devices.push(Box::new(fs));
    }
    if cfg.rng {
        let rng = crate::devices::virtio::rng::Rng::new().map_err(device_error("virtio-rng".to_string()))?;
        devices.push(Box::new(rng));
    }
    if cfg.balloon {
        let balloon =
            crate::devices::virtio::balloon::Balloon::new().map_err(device_error("virtio-balloon".to_string()))?;
        devices.push(Box::new(balloon));
    }
    Ok(devices)
}

impl Machine {
    /// Opens what `cfg` names ([`HostFiles::open`]) and assembles the machine.
    pub fn build(cfg: &VmConfig) -> Result<Self, MachineError> {
        Self::assemble(cfg, HostFiles::open(cfg)?)
    }

    /// Assembles the machine `cfg` describes over files opened earlier; opens nothing by path.
    pub fn assemble(cfg: &VmConfig, files: HostFiles) -> Result<Self, MachineError> {
        crate::config::validate(cfg)?;
        let vsock_socket = files.vsock_path().map(Path::to_path_buf);
        let HostFiles { kvm, kernel, initrd, disks, console, vsock, fs, control, .. } = files;
        let size = (cfg.memory_mib as usize) << 20;
        // Only virtiofsd (vhost-user) maps guest memory besides us: without shared folders the
        // memory is anonymous, which the host backs with huge pages (see vstate::memory).
        let (mem, memfd) = if cfg.fs.is_empty() {
            (memory::anonymous(size)?, None)
        } else {
            let (mem, fd) = memory::memfd_backed(size)?;
            (mem, Some(fd))
        };
        let vm = Vm::with_kvm(kvm, mem.clone())?;
        vm.setup_irqchip()?;

        let console = ConsoleLog::to_file(console);
        let legacy = Self::legacy_bus(&vm, &console, None)?;

        let (mmio, slots) = Self::attach_virtio(&vm, &mem, virtio_devices(cfg, disks, vsock, fs)?, None)?;
        let spec = BootSpec {
            kernel: &cfg.kernel,
            initrd: cfg.initrd.as_deref(),
            cmdline: &cfg.cmdline,
            cpus: cfg.cpus,
            devices: &slots,
        };
        let entry: BootEntry = boot::load_files(&mem, &spec, kernel, initrd)?;

        let mut vcpus = Vec::with_capacity(cfg.cpus as usize);
        for id in 0..cfg.cpus {
            let vcpu = Vcpu::new(&vm, id, cfg.cpus)?;
            vcpu.configure_linux(&vm, entry)?;
            vcpus.push(vcpu);
        }
        Ok(Self {
            vm,
            vcpus,
            bus: Arc::new(IoBus::new(legacy, mmio)),
            console,
            _memfd: memfd,
            vsock_socket,
            control,
            memory_size: size as u64,
            restored: None,
            launched: None,
        })
    }

    /// The machine `cfg` describes, as the snapshot opened with [`HostFiles::with_snapshot`] left
    /// it: guest memory mapped `MAP_PRIVATE` from the memory file, the devices `cfg` names
    /// (which must be those of the snapshot, in order) restored onto new host resources, the
    /// vCPUs where they were. Nothing is loaded or booted; the guest resumes.
    pub fn restore(cfg: &VmConfig, mut files: HostFiles) -> Result<Self, MachineError> {
        crate::config::validate(cfg)?;
        let snapshot_error = |e: crate::snapshot::SnapshotError| MachineError::Snapshot(e.to_string());
        let OpenedSnapshot { state, memory: memory_file, path: memory_path, prefault, load_ms } =
            files.snapshot.take().ok_or_else(|| MachineError::Snapshot("no snapshot was opened".into()))?;
        let mut phases = RestorePhases { state: load_ms, ..Default::default() };
        let mut at = Instant::now();
        let mut lap = || {
            let ms = at.elapsed().as_millis() as u64;
            at = Instant::now();
            ms
        };
        let size = (cfg.memory_mib as u64) << 20;
        if state.memory_size != size || state.vcpus.len() != cfg.cpus as usize {
            return Err(MachineError::Snapshot(format!(
                "the snapshot has {} MiB and {} vCPUs, the configuration {} MiB and {}",
                state.memory_size >> 20,
                state.vcpus.len(),
                cfg.memory_mib,
                cfg.cpus
            )));
        }
        let vsock_socket = files.vsock_path().map(Path::to_path_buf);
        let HostFiles { kvm, disks, console, vsock, fs, control, .. } = files;
        // virtiofsd maps guest memory from a descriptor: with shared folders it is a copy in a
        // memfd of its own, not the file mapped privately.
        let (mem, memfd) = if cfg.fs.is_empty() {
            let mem = crate::snapshot::memory::map_private_file(&memory_file, &memory_path, size, prefault);
            (mem.map_err(snapshot_error)?, None)
        } else {
            let (mem, fd) =
                crate::snapshot::memory::copy_to_memfd(&memory_file, &memory_path, size).map_err(snapshot_error)?;
            (mem, Some(fd))
        };
        phases.memory = lap();
        let vm = Vm::with_kvm(kvm, mem.clone())?;
        vm.setup_irqchip()?;

        // The interrupt controllers and vCPUs first: restoring them replaces their pending
        // state, so an interrupt a restored device raises (a pending status, vsock's reset
        // event) must come after, or it would be wiped.
        let mut vcpus = Vec::with_capacity(cfg.cpus as usize);
        for id in 0..cfg.cpus {
            vcpus.push(Vcpu::new(&vm, id, cfg.cpus)?);
        }
        let fds: Vec<&kvm_ioctls::VcpuFd> = vcpus.iter().map(|v| &v.fd).collect();
        state.check_vcpus(&fds).map_err(snapshot_error)?;
        state.vm.restore(&vm.fd).map_err(snapshot_error)?;
        for (vcpu, saved) in vcpus.iter().zip(&state.vcpus) {
            saved.restore(&vm.kvm, &vcpu.fd).map_err(snapshot_error)?;
        }
        phases.vcpus = lap();
        let console = ConsoleLog::to_file(console);
        let legacy = Self::legacy_bus(&vm, &console, state.serial.as_ref())?;

        let mut devices = virtio_devices(cfg, disks, vsock, fs)?;
        if cfg.balloon && devices.len() == state.devices.len() + 1 {
            // A snapshot of a VM that had no balloon (taken before there was one): its guest
            // knows no such device, so it restores without one. The balloon is the last device.
            devices.pop();
        }
        if devices.len() != state.devices.len() {
            return Err(MachineError::Snapshot(format!(
                "the snapshot has {} virtio devices, the configuration {}",
                state.devices.len(),
                devices.len()
            )));
        }
        let (mmio, _) = Self::attach_virtio(&vm, &mem, devices, Some(&state.devices))?;
        phases.devices = lap();

        Ok(Self {
            vm,
            vcpus,
            bus: Arc::new(IoBus::new(legacy, mmio)),
            console,
            _memfd: memfd,
            vsock_socket,
            control,
            memory_size: size,
            restored: Some(phases),
            launched: None,
        })
    }

    /// Says when the process started: a restored machine then prints, as its vCPUs go, one
    /// line of where the time went (`umbra-vmm: restored in N ms (phases)`, which `vmctl bench
    /// vmm` reads).
    pub fn launched_at(mut self, at: Instant) -> Self {
        self.launched = Some(at);
        self
    }

    /// Gives each device its MMIO window and IRQ, with the notify ioeventfds and the irqfd.
    /// With `saved` (one state per device), each transport is restored as a snapshot left it;
    /// an interrupt it raises before its irqfd is registered stays pending in the eventfd, and
    /// KVM injects it on registration.
    fn attach_virtio(
        vm: &Vm,
        mem: &GuestMemory,
        devices: Vec<Box<dyn VirtioDevice>>,
        saved: Option<&[TransportState]>,
    ) -> Result<(MmioDevices, Vec<MmioSlot>), MachineError> {
        let mut mmio = Vec::new();
        let mut slots = Vec::new();
        for (i, device) in devices.into_iter().enumerate() {
            let base = VIRTIO_MMIO_START + i as u64 * MMIO_WINDOW;
            let irq = VIRTIO_IRQ_START + i as u32;
            let transport = match saved.and_then(|s| s.get(i)) {
                Some(state) => MmioTransport::restore(device, mem.clone(), state)?,
                None => MmioTransport::new(device, mem.clone())?,
            };
            vm.register_irqfd(transport.irq_evt(), irq)?;
            for (q, evt) in transport.queue_evts().iter().enumerate() {
                vm.register_mmio_ioeventfd(evt, base + QUEUE_NOTIFY_OFFSET, q as u32)?;
            }
            slots.push(MmioSlot { base, size: MMIO_WINDOW, irq });
            mmio.push((base, transport));
        }
        Ok((mmio, slots))
    }

    /// The i8042 and the serial console on `console`, its IRQ wired through an irqfd; the UART
    /// as `saved` left it, if given.
    fn legacy_bus(vm: &Vm, console: &ConsoleLog, saved: Option<&SerialSnapshot>) -> Result<LegacyBus, MachineError> {
        let serial_irq = EventFd::new(EFD_NONBLOCK).map_err(device_error("eventfd"))?;
        vm.register_irqfd(&serial_irq, SERIAL_IRQ)?;
        let serial = match saved {
            Some(saved) => SerialConsole::restore(console.clone(), serial_irq, saved)?,
            None => SerialConsole::with_interrupt(console.clone(), serial_irq),
        };
        Ok(LegacyBus::with_serial(serial))
    }

    pub fn console(&self) -> &ConsoleLog {
        &self.console
    }

    /// Runs every vCPU on its own thread until the first one stops, and says why. A reset
    /// after a kernel panic message is reported as a panic. With a control socket, a snapshot
    /// taken through it ends the run too ([`VmExit::Snapshotted`]).
    pub fn run(self) -> Result<VmExit, MachineError> {
        let started = Instant::now();
        let (tx, rx) = mpsc::channel();
        let mut handles = Vec::new();
        let vm = Arc::new(self.vm);
        let pause = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let resume = Arc::new(crate::control::Resume::default());
        let (states_tx, states) = mpsc::channel();
        // Every vCPU paused before any reads its state: an IPI from a still-running vCPU after
        // one had read its LAPIC would be lost.
        let all_paused = Arc::new(std::sync::Barrier::new(self.vcpus.len()));
        crate::vstate::vcpu::install_kick_handler()?;
        // No vCPU enters the guest before every thread, this one included, is filtered.
        let filtered = Arc::new(std::sync::Barrier::new(self.vcpus.len() + 1));
        for mut vcpu in self.vcpus {
            let (bus, tx, filtered) = (self.bus.clone(), tx.clone(), filtered.clone());
            let (vm, pause, states_tx, all_paused) = (vm.clone(), pause.clone(), states_tx.clone(), all_paused.clone());
            let resume = resume.clone();
            let handle = crate::seccomp::spawn_filtered(
                crate::seccomp::ThreadKind::Vcpu,
                &format!("vcpu{}", vcpu.id()),
                move || {
                    filtered.wait();
                    // A panic in a vCPU thread must end the VM with a status, not leave the
                    // other threads (or none) running: report it as an internal error.
                    let id = vcpu.id();
                    let exit = loop {
                        let run =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vcpu.run_until(&bus, &pause)));
                        match run {
                            Ok(Run::Exit(exit)) => break exit,
                            Ok(Run::Paused) => {
                                // A snapshot or a fork: hand the state over and wait. A snapshot
                                // ends the VM, so its pause never ends; a fork's does.
                                let pause_number = resume.generation();
                                all_paused.wait();
                                match crate::snapshot::VcpuState::capture(&vm.kvm, &vcpu.fd, id) {
                                    Ok(state) => {
                                        let _ = states_tx.send(state);
                                        resume.wait_past(pause_number);
                                    }
                                    Err(e) => break VmExit::Internal(format!("vCPU {id}: {e}")),
                                }
                            }
                            Err(_) => break VmExit::Internal(format!("vCPU {id} thread panicked")),
                        }
                    };
                    let _ = tx.send(exit);
                },
            )
            .map_err(MachineError::Thread)?;
            handles.push(handle);
        }
        if let Some(listener) = self.control {
            use std::os::unix::thread::JoinHandleExt;
            let snapshotter = crate::control::Snapshotter {
                vm: vm.clone(),
                bus: self.bus.clone(),
                pause,
                vcpus: handles.iter().map(|h| h.as_pthread_t()).collect(),
                states,
                memory_size: self.memory_size,
                resume,
            };
            let tx = tx.clone();
            let control =
                crate::seccomp::spawn_filtered(crate::seccomp::ThreadKind::Control, "umbra-control", move || {
                    crate::control::serve(listener, snapshotter, tx)
                })
                .map_err(MachineError::Thread)?;
            std::mem::forget(control);
        }
        drop(tx);
        crate::seccomp::install(crate::seccomp::ThreadKind::Main).map_err(MachineError::Seccomp)?;
        filtered.wait();
        if let (Some(mut phases), Some(launched)) = (self.restored, self.launched) {
            phases.threads = started.elapsed().as_millis() as u64;
            eprintln!("umbra-vmm: restored in {} ms ({phases})", launched.elapsed().as_millis());
        }
        let exit = rx.recv().unwrap_or_else(|_| VmExit::Internal("every vCPU thread ended without an exit".into()));
        // The other vCPUs are still in KVM_RUN: the VM and its memory must stay mapped until the
        // caller ends the process, which stops them.
        std::mem::forget(vm);
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
