//! The macOS shim over Virtualization.framework (through objc2): turns a [`VzConfig`] into a
//! `VZVirtualMachine`, one VZ object per item, and drives it.
//!
//! A `VZVirtualMachine` belongs to the serial dispatch queue it is created with: every call on
//! it and on its devices must run there, and its completion handlers and delegate methods run
//! there too. So [`VzMachine`] owns its queue and makes every call through `exec_sync` on it;
//! the callbacks report back through channels and [`Shared`] state. The blocking methods are
//! for ordinary (`spawn_blocking`) threads, never for that queue itself.
//!
//! A `VZVirtioSocketConnection` closes its file descriptor when it is released, so
//! [`VzMachine::connect`] hands out a `dup` of it and lets the connection object go.

use std::mem::ManuallyDrop;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use block2::RcBlock;
use dispatch2::{DispatchQueue, DispatchRetained};
use objc2::rc::Retained;
use objc2::runtime::ProtocolObject;
use objc2::{define_class, msg_send, AllocAnyThread, DefinedClass};
use objc2_foundation::{NSArray, NSDictionary, NSError, NSFileHandle, NSObject, NSObjectProtocol, NSString, NSURL};
use objc2_virtualization::{
    VZDirectorySharingDeviceConfiguration, VZDiskImageStorageDeviceAttachment, VZEntropyDeviceConfiguration,
    VZFileHandleSerialPortAttachment, VZLinuxBootLoader, VZMultipleDirectoryShare, VZSerialPortConfiguration,
    VZSharedDirectory, VZSocketDeviceConfiguration, VZStorageDeviceConfiguration, VZVirtioBlockDeviceConfiguration,
    VZVirtioConsoleDeviceSerialPortConfiguration, VZVirtioEntropyDeviceConfiguration, VZVirtioFileSystemDevice,
    VZVirtioFileSystemDeviceConfiguration, VZVirtioSocketConnection, VZVirtioSocketDevice,
    VZVirtioSocketDeviceConfiguration, VZVirtioSocketListener, VZVirtioSocketListenerDelegate, VZVirtualMachine,
    VZVirtualMachineConfiguration, VZVirtualMachineDelegate,
};

use super::{VzConfig, VzDevice, VzShare};

/// How long [`VzMachine::stop`] waits for the framework to confirm a forced stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a VM is in its life, as its completion handlers and delegate report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VzState {
    /// Created, and not (yet) confirmed started.
    Starting,
    Running,
    /// The guest powered off, or [`VzMachine::stop`] stopped it.
    Stopped,
    /// The framework stopped the VM (or refused to start it) with this error.
    Failed(String),
}

impl VzState {
    fn is_live(&self) -> bool {
        matches!(self, VzState::Starting | VzState::Running)
    }
}

/// What the callbacks on the VM's queue tell the Rust side.
struct Shared {
    state: Mutex<VzState>,
    changed: Condvar,
    announced: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, VzState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves a live VM to `to`; a VM that has ended keeps the first reason it ended.
    fn transition(&self, to: VzState) {
        let mut state = self.lock();
        if state.is_live() {
            *state = to;
            self.changed.notify_all();
        }
    }

    /// Waits up to `timeout` for the VM to end; whether it has.
    fn wait_ended(&self, timeout: Duration) -> bool {
        let state = self.lock();
        let (state, _) =
            self.changed.wait_timeout_while(state, timeout, |s| s.is_live()).unwrap_or_else(PoisonError::into_inner);
        !state.is_live()
    }
}

define_class!(
    // SAFETY: NSObject has no subclassing requirements, and `VmDelegate` does not implement Drop.
    #[unsafe(super(NSObject))]
    #[ivars = Arc<Shared>]
    struct VmDelegate;

    // SAFETY: NSObjectProtocol has no safety requirements.
    unsafe impl NSObjectProtocol for VmDelegate {}

    // SAFETY: the signatures are those of the protocol's methods.
    unsafe impl VZVirtualMachineDelegate for VmDelegate {
        #[unsafe(method(guestDidStopVirtualMachine:))]
        fn guest_did_stop(&self, _vm: &VZVirtualMachine) {
            self.ivars().transition(VzState::Stopped);
        }

        #[unsafe(method(virtualMachine:didStopWithError:))]
        fn did_stop_with_error(&self, _vm: &VZVirtualMachine, error: &NSError) {
            self.ivars().transition(VzState::Failed(describe(error)));
        }
    }
);

define_class!(
    // SAFETY: NSObject has no subclassing requirements, and `ReadyListener` does not implement
    // Drop.
    #[unsafe(super(NSObject))]
    #[ivars = Arc<Shared>]
    struct ReadyListener;

    // SAFETY: NSObjectProtocol has no safety requirements.
    unsafe impl NSObjectProtocol for ReadyListener {}

    // SAFETY: the signature is that of the protocol's method.
    unsafe impl VZVirtioSocketListenerDelegate for ReadyListener {
        /// The agent's announcement: a connection it closes at once, so it need not be kept.
        #[unsafe(method(listener:shouldAcceptNewConnection:fromSocketDevice:))]
        fn should_accept(
            &self,
            _listener: &VZVirtioSocketListener,
            _connection: &VZVirtioSocketConnection,
            _device: &VZVirtioSocketDevice,
        ) -> bool {
            self.ivars().announced.store(true, Ordering::Release);
            true
        }
    }
);

impl VmDelegate {
    fn new(shared: Arc<Shared>) -> Retained<Self> {
        let this = Self::alloc().set_ivars(shared);
        // SAFETY: `init` is NSObject's designated initializer.
        unsafe { msg_send![super(this), init] }
    }
}

impl ReadyListener {
    fn new(shared: Arc<Shared>) -> Retained<Self> {
        let this = Self::alloc().set_ivars(shared);
        // SAFETY: `init` is NSObject's designated initializer.
        unsafe { msg_send![super(this), init] }
    }
}

/// The framework's objects for one VM.
struct Vz {
    vm: Retained<VZVirtualMachine>,
    socket: Option<Retained<VZVirtioSocketDevice>>,
    /// Delegates are weak properties: these keep them alive as long as the VM.
    _delegate: Retained<VmDelegate>,
    _ready: Option<(Retained<VZVirtioSocketListener>, Retained<ReadyListener>)>,
}

// SAFETY: a `Vz` is only ever used on its VM's serial queue: created in `VzMachine::create`
// inside `exec_sync` on it, used only inside `VzMachine::on_queue`, and released on it by
// `VzMachine`'s Drop. Sending or sharing it between threads never touches the objects outside
// that queue, which is what the framework requires of them.
unsafe impl Send for Vz {}
// SAFETY: as for Send: every access goes through the VM's serial queue, one at a time.
unsafe impl Sync for Vz {}

/// A Virtualization.framework VM, with its own serial dispatch queue.
pub struct VzMachine {
    queue: DispatchRetained<DispatchQueue>,
    vz: ManuallyDrop<Vz>,
    shared: Arc<Shared>,
    /// The read end of the console pipe, until the runtime takes it.
    console: Mutex<Option<OwnedFd>>,
}

impl VzMachine {
    /// Builds and validates the configuration, then creates the VM on its own serial queue,
    /// with a delegate recording how it stops and a listener for the agent's announcement on
    /// the socket device's ready port.
    pub fn create(cfg: &VzConfig) -> Result<VzMachine, String> {
        let queue = DispatchQueue::new("umbra.vz", None);
        let shared = Arc::new(Shared {
            state: Mutex::new(VzState::Starting),
            changed: Condvar::new(),
            announced: AtomicBool::new(false),
        });
        let (vz, console) = on_queue(&queue, || build(cfg, &queue, &shared))?;
        Ok(VzMachine { queue, vz: ManuallyDrop::new(vz), shared, console: Mutex::new(console) })
    }

    /// The read end of the console pipe (once): the guest's console output.
    pub fn take_console(&self) -> Option<OwnedFd> {
        self.console.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Starts the VM, waiting up to `timeout` for the framework to confirm it.
    pub fn start(&self, timeout: Duration) -> Result<(), String> {
        let (tx, rx) = mpsc::channel();
        let shared = self.shared.clone();
        self.on_queue(move |vz| {
            // SAFETY: on the VM's queue.
            if !unsafe { vz.vm.canStart() } {
                return Err("the VM cannot start in its current state".to_string());
            }
            let handler = RcBlock::new(move |error: *mut NSError| {
                // SAFETY: the framework passes nil or a valid NSError.
                let result = match unsafe { error.as_ref() } {
                    None => {
                        shared.transition(VzState::Running);
                        Ok(())
                    }
                    Some(e) => {
                        let e = describe(e);
                        shared.transition(VzState::Failed(e.clone()));
                        Err(e)
                    }
                };
                let _ = tx.send(result);
            });
            // SAFETY: on the VM's queue, which the handler is called on.
            unsafe { vz.vm.startWithCompletionHandler(&handler) };
            Ok(())
        })?;
        wait(&rx, timeout, "start")?
    }

    /// Whether the agent has connected to the ready port.
    pub fn announced(&self) -> bool {
        self.shared.announced.load(Ordering::Acquire)
    }

    /// Connects to `port` in the guest, waiting up to `timeout`; the connection's descriptor.
    pub fn connect(&self, port: u32, timeout: Duration) -> Result<OwnedFd, String> {
        let (tx, rx) = mpsc::channel();
        self.on_queue(move |vz| {
            let socket = vz.socket.as_ref().ok_or("the VM has no virtio socket device")?;
            let handler = RcBlock::new(move |connection: *mut VZVirtioSocketConnection, error: *mut NSError| {
                // SAFETY: the framework passes nil or valid objects, alive for this call.
                let result = match unsafe { (connection.as_ref(), error.as_ref()) } {
                    (_, Some(e)) => Err(describe(e)),
                    (Some(c), None) => dup(c),
                    (None, None) => Err("the framework returned neither a connection nor an error".to_string()),
                };
                let _ = tx.send(result);
            });
            // SAFETY: on the VM's queue, which the handler is called on.
            unsafe { socket.connectToPort_completionHandler(port, &handler) };
            Ok::<_, String>(())
        })?;
        wait(&rx, timeout, &format!("connect to port {port}"))?
    }

    pub fn state(&self) -> VzState {
        self.shared.lock().clone()
    }

    /// Asks the guest to power off and gives it `grace` to; then stops the VM outright.
    pub fn stop(&self, grace: Duration) {
        if !grace.is_zero() {
            let requested = self.on_queue(|vz| {
                // SAFETY: on the VM's queue.
                unsafe { vz.vm.canRequestStop() && vz.vm.requestStopWithError().is_ok() }
            });
            if requested && self.shared.wait_ended(grace) {
                return;
            }
        }
        if self.request_stop() && !self.shared.wait_ended(STOP_TIMEOUT) {
            tracing::warn!("Virtualization.framework did not confirm the VM stopped within {STOP_TIMEOUT:?}");
        }
    }

    /// Stops the VM outright without waiting for the framework to confirm it (for `Drop` and
    /// other places that must not block); [`Self::state`] turns `Stopped` once it has.
    pub fn kill(&self) {
        self.request_stop();
    }

    /// Asks the framework to stop the VM outright; whether it could (a VM still starting, or
    /// already stopped, cannot be).
    fn request_stop(&self) -> bool {
        let shared = self.shared.clone();
        self.on_queue(move |vz| {
            // SAFETY: on the VM's queue.
            if !unsafe { vz.vm.canStop() } {
                return false;
            }
            let handler = RcBlock::new(move |error: *mut NSError| {
                // SAFETY: the framework passes nil or a valid NSError.
                match unsafe { error.as_ref() } {
                    None => shared.transition(VzState::Stopped),
                    Some(e) => tracing::warn!("Virtualization.framework could not stop the VM: {}", describe(e)),
                }
            });
            // SAFETY: on the VM's queue, which the handler is called on.
            unsafe { vz.vm.stopWithCompletionHandler(&handler) };
            true
        })
    }

    /// Replaces the share set of the running VM's file system device tagged `tag`.
    pub fn set_shares(&self, tag: &str, shares: &[VzShare]) -> Result<(), String> {
        self.on_queue(|vz| {
            let share = directory_share(shares)?;
            // SAFETY: on the VM's queue.
            let devices = unsafe { vz.vm.directorySharingDevices() };
            let device = devices
                .to_vec()
                .into_iter()
                .filter_map(|d| d.downcast::<VZVirtioFileSystemDevice>().ok())
                // SAFETY: on the VM's queue.
                .find(|d| unsafe { d.tag() }.to_string() == tag)
                .ok_or_else(|| format!("the VM has no file system device tagged {tag:?}"))?;
            // SAFETY: on the VM's queue; `share` is a valid share.
            unsafe { device.setShare(Some(&share)) };
            Ok(())
        })
    }

    /// Runs `f` on the VM's queue, blocking until it returns.
    fn on_queue<R: Send>(&self, f: impl FnOnce(&Vz) -> R + Send) -> R {
        let vz: &Vz = &self.vz;
        on_queue(&self.queue, move || f(vz))
    }
}

impl Drop for VzMachine {
    fn drop(&mut self) {
        // SAFETY: `self.vz` is not used again.
        let vz = unsafe { ManuallyDrop::take(&mut self.vz) };
        // The objects are released on their queue, like every other use of them.
        self.queue.exec_async(move || drop(vz));
    }
}

/// Runs `f` on `queue`, blocking until it returns.
fn on_queue<R: Send>(queue: &DispatchQueue, f: impl FnOnce() -> R + Send) -> R {
    let mut out = None;
    queue.exec_sync(|| out = Some(f()));
    out.expect("exec_sync runs its work before returning")
}

/// Waits for a completion handler's result.
fn wait<T>(rx: &mpsc::Receiver<T>, timeout: Duration, what: &str) -> Result<T, String> {
    rx.recv_timeout(timeout).map_err(|e| match e {
        mpsc::RecvTimeoutError::Timeout => format!("Virtualization.framework did not {what} within {timeout:?}"),
        mpsc::RecvTimeoutError::Disconnected => format!("Virtualization.framework dropped the {what} request"),
    })
}

/// Creates the VM, and the read end of its console pipe; runs on `queue`.
fn build(cfg: &VzConfig, queue: &DispatchQueue, shared: &Arc<Shared>) -> Result<(Vz, Option<OwnedFd>), String> {
    let (config, console) = configuration(cfg)?;
    // SAFETY: on `queue`, a serial queue the VM keeps using; the configuration is valid.
    let vm = unsafe { VZVirtualMachine::initWithConfiguration_queue(VZVirtualMachine::alloc(), &config, queue) };
    let delegate = VmDelegate::new(shared.clone());
    // SAFETY: on the VM's queue; `Vz` keeps the delegate alive as long as the VM.
    unsafe { vm.setDelegate(Some(ProtocolObject::from_ref(&*delegate))) };
    // SAFETY: on the VM's queue.
    let socket = unsafe { vm.socketDevices() }.firstObject().and_then(|d| d.downcast::<VZVirtioSocketDevice>().ok());
    let ready_port = cfg.devices.iter().find_map(|d| match d {
        VzDevice::Socket { ready_port, .. } => Some(*ready_port),
        _ => None,
    });
    let ready = match (&socket, ready_port) {
        (Some(socket), Some(port)) => {
            // SAFETY: a plain object, created on the VM's queue.
            let listener = unsafe { VZVirtioSocketListener::new() };
            let delegate = ReadyListener::new(shared.clone());
            // SAFETY: on the VM's queue; `Vz` keeps the listener and its delegate alive.
            unsafe {
                listener.setDelegate(Some(ProtocolObject::from_ref(&*delegate)));
                socket.setSocketListener_forPort(&listener, port);
            }
            Some((listener, delegate))
        }
        _ => None,
    };
    Ok((Vz { vm, socket, _delegate: delegate, _ready: ready }, console))
}

/// The VM's configuration, validated, and the read end of its console pipe.
fn configuration(cfg: &VzConfig) -> Result<(Retained<VZVirtualMachineConfiguration>, Option<OwnedFd>), String> {
    // SAFETY: configuration objects are plain data, used by this thread only until the VM copies
    // them; every argument is a valid object of the declared type.
    let boot = unsafe {
        let boot = VZLinuxBootLoader::initWithKernelURL(VZLinuxBootLoader::alloc(), &*file_url(&cfg.kernel)?);
        boot.setCommandLine(&NSString::from_str(&cfg.cmdline));
        if let Some(initrd) = &cfg.initrd {
            boot.setInitialRamdiskURL(Some(&*file_url(initrd)?));
        }
        boot
    };
    let mut storage: Vec<Retained<VZStorageDeviceConfiguration>> = Vec::new();
    let mut sockets: Vec<Retained<VZSocketDeviceConfiguration>> = Vec::new();
    let mut sharing: Vec<Retained<VZDirectorySharingDeviceConfiguration>> = Vec::new();
    let mut entropy: Vec<Retained<VZEntropyDeviceConfiguration>> = Vec::new();
    let mut serial: Vec<Retained<VZSerialPortConfiguration>> = Vec::new();
    let mut console = None;
    for device in &cfg.devices {
        // SAFETY: as above.
        unsafe {
            match device {
                VzDevice::Block { path, read_only } => {
                    let attachment = VZDiskImageStorageDeviceAttachment::initWithURL_readOnly_error(
                        VZDiskImageStorageDeviceAttachment::alloc(),
                        &*file_url(path)?,
                        *read_only,
                    )
                    .map_err(|e| format!("disk image {}: {}", path.display(), describe(&e)))?;
                    let block = VZVirtioBlockDeviceConfiguration::initWithAttachment(
                        VZVirtioBlockDeviceConfiguration::alloc(),
                        &attachment,
                    );
                    storage.push(Retained::into_super(block));
                }
                VzDevice::Socket { .. } => sockets.push(Retained::into_super(VZVirtioSocketDeviceConfiguration::new())),
                VzDevice::FileSystem { tag, shares } => {
                    let ns_tag = NSString::from_str(tag);
                    VZVirtioFileSystemDeviceConfiguration::validateTag_error(&ns_tag)
                        .map_err(|e| format!("file system tag {tag:?}: {}", describe(&e)))?;
                    let fs = VZVirtioFileSystemDeviceConfiguration::initWithTag(
                        VZVirtioFileSystemDeviceConfiguration::alloc(),
                        &ns_tag,
                    );
                    let share = directory_share(shares)?;
                    fs.setShare(Some(&share));
                    sharing.push(Retained::into_super(fs));
                }
                VzDevice::Entropy => entropy.push(Retained::into_super(VZVirtioEntropyDeviceConfiguration::new())),
                VzDevice::Console { log } => {
                    let (read, write) = pipe().map_err(|e| format!("console pipe for {}: {e}", log.display()))?;
                    // The handle owns the write end from here and closes it when released.
                    let write = NSFileHandle::initWithFileDescriptor_closeOnDealloc(
                        NSFileHandle::alloc(),
                        write.into_raw_fd(),
                        true,
                    );
                    let attachment =
                        VZFileHandleSerialPortAttachment::initWithFileHandleForReading_fileHandleForWriting(
                            VZFileHandleSerialPortAttachment::alloc(),
                            None,
                            Some(&write),
                        );
                    let port = VZVirtioConsoleDeviceSerialPortConfiguration::new();
                    port.setAttachment(Some(&attachment));
                    console = Some(read);
                    serial.push(Retained::into_super(port));
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe {
        let config = VZVirtualMachineConfiguration::new();
        config.setBootLoader(Some(&boot));
        config.setCPUCount(cfg.cpus as usize);
        config.setMemorySize(cfg.memory_bytes);
        config.setStorageDevices(&NSArray::from_retained_slice(&storage));
        config.setSocketDevices(&NSArray::from_retained_slice(&sockets));
        config.setDirectorySharingDevices(&NSArray::from_retained_slice(&sharing));
        config.setEntropyDevices(&NSArray::from_retained_slice(&entropy));
        config.setSerialPorts(&NSArray::from_retained_slice(&serial));
        config.validateWithError().map_err(|e| format!("invalid configuration: {}", describe(&e)))?;
        Ok((config, console))
    }
}

/// A `VZMultipleDirectoryShare` of `shares`, by name.
fn directory_share(shares: &[VzShare]) -> Result<Retained<VZMultipleDirectoryShare>, String> {
    let mut names = Vec::with_capacity(shares.len());
    let mut directories = Vec::with_capacity(shares.len());
    for share in shares {
        let name = NSString::from_str(&share.name);
        // SAFETY: a class method given a valid string. Checked here because
        // `initWithDirectories:` raises an exception for an invalid name.
        unsafe { VZMultipleDirectoryShare::validateName_error(&name) }
            .map_err(|e| format!("share name {:?}: {}", share.name, describe(&e)))?;
        let url = NSURL::from_directory_path(&share.path)
            .ok_or_else(|| format!("{} is not a usable directory path", share.path.display()))?;
        // SAFETY: a plain object initialised with a file URL.
        directories.push(unsafe {
            VZSharedDirectory::initWithURL_readOnly(VZSharedDirectory::alloc(), &url, share.read_only)
        });
        names.push(name);
    }
    let keys: Vec<&NSString> = names.iter().map(|n| &**n).collect();
    let directories = NSDictionary::from_retained_objects(&keys, &directories);
    // SAFETY: every name was validated above.
    Ok(unsafe { VZMultipleDirectoryShare::initWithDirectories(VZMultipleDirectoryShare::alloc(), &directories) })
}

/// A pipe, both ends close-on-exec (macOS has no pipe2).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe just returned these two descriptors, owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    for fd in [&read, &write] {
        use std::os::fd::AsRawFd;
        // SAFETY: F_SETFD on a descriptor we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((read, write))
}

/// A file URL for `path`.
fn file_url(path: &Path) -> Result<Retained<NSURL>, String> {
    NSURL::from_file_path(path).ok_or_else(|| format!("{} is not a usable file path", path.display()))
}

/// A copy of `connection`'s descriptor, which the connection closes when it is released.
fn dup(connection: &VZVirtioSocketConnection) -> Result<OwnedFd, String> {
    // SAFETY: called on the VM's queue, from the completion handler that received `connection`.
    let raw = unsafe { connection.fileDescriptor() };
    // SAFETY: the connection keeps `raw` open while it is alive, which outlasts this borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(raw) };
    fd.try_clone_to_owned().map_err(|e| format!("cannot duplicate the connection's descriptor: {e}"))
}

/// What an NSError says.
fn describe(error: &NSError) -> String {
    error.localizedDescription().to_string()
}
