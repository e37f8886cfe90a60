"""This machine's network interfaces and their IPv4 addresses, as MPI and NCCL would see them.

Standard library only (it runs inside ``python -m ringplug.run.hosts.probe`` on every host of a
job). Addresses come from the kernel (``SIOCGIFCONF``), so aliases (``eth0:1``) are listed
too; facts the kernel keeps in sysfs (link speed, whether a device is virtual, InfiniBand
ports) are read from there where it exists.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_SIOCGIFCONF = 0x8912
_SIOCGIFFLAGS = 0x8913
_SIOCGIFNETMASK = 0x891B
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
# struct ifreq: a 16-byte name and a union whose largest member is 24 bytes on 64-bit Linux.
_IFREQ_SIZE = 40 if struct.calcsize("P") == 8 else 32
_MAX_ADDRESSES = 512

_SYS_NET = Path("/sys/class/net")
_SYS_INFINIBAND = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of a network interface.

    Args:
        name: the device name MPI and NCCL take (``eth0``; an alias ``eth0:1`` is ``eth0``).
        address: the IPv4 address, e.g. ``"10.0.0.1"``.
        prefix_length: the netmask as a prefix length, e.g. ``24``.
        up: whether the interface is administratively up.
        loopback: whether it is a loopback device (``lo``).
        virtual: whether the kernel lists it as virtual (bridges such as ``docker0``,
            ``veth`` pairs, tunnels); ``False`` where sysfs cannot tell.
        speed_mbps: link speed from sysfs, ``0`` when unknown.
    """

    name: str
    address: str
    prefix_length: int
    up: bool = True
    loopback: bool = False
    virtual: bool = False
    speed_mbps: int = 0

    @property
    def network(self) -> str:
        """The subnet in CIDR form, e.g. ``"10.0.0.0/24"`` (what Open MPI's include lists take)."""
        return str(ipaddress.ip_interface(f"{self.address}/{self.prefix_length}").network)

    def describe(self) -> str:
        """``eth0 10.0.0.1/24`` for reports."""
        return f"{self.name} {self.address}/{self.prefix_length}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Interface:
        """The inverse of :meth:`to_dict`; unknown keys (from a newer ringplug) are ignored."""
        known = {key: values[key] for key in cls.__dataclass_fields__ if key in values}
        return cls(**known)


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    return fcntl.ioctl(sock.fileno(), request, struct.pack("16s24x", name.encode()[:15]))


def _sysfs_int(path: Path) -> int:
    try:
        return max(0, int(path.read_text().strip()))
    except (OSError, ValueError):
        # Virtual devices answer "Invalid argument" for speed.
        return 0


def _address_table(sock: socket.socket) -> list[tuple[str, str]]:
    """(label, address) for every IPv4 address the kernel knows, in the kernel's order."""
    buffer = array.array("B", bytes(_IFREQ_SIZE * _MAX_ADDRESSES))
    pointer, _ = buffer.buffer_info()
    answer = fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, struct.pack("iL", len(buffer), pointer))
    length, _ = struct.unpack("iL", answer)
    data = buffer.tobytes()[:length]
    table = []
    for offset in range(0, length, _IFREQ_SIZE):
        label = data[offset : offset + 16].split(b"\0", 1)[0].decode(errors="replace")
        address = socket.inet_ntoa(data[offset + 20 : offset + 24])
        table.append((label, address))
    return table


def local_interfaces() -> list[Interface]:
    """Every IPv4 address on this machine with its interface's facts; ``[]`` off Linux."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return []
    interfaces = []
    with sock:
        try:
            table = _address_table(sock)
        except OSError:
            return []
        for label, address in table:
            try:
                flags = struct.unpack("H", _ioctl(sock, _SIOCGIFFLAGS, label)[16:18])[0]
                mask = socket.inet_ntoa(_ioctl(sock, _SIOCGIFNETMASK, label)[20:24])
            except OSError:
                continue  # gone between the two calls
            name = label.split(":", 1)[0]
            interfaces.append(
                Interface(
                    name=name,
                    address=address,
                    prefix_length=ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen,
                    up=bool(flags & _IFF_UP),
                    loopback=bool(flags & _IFF_LOOPBACK),
                    virtual=(_SYS_NET / name).resolve().parent.parent.name == "virtual",
                    speed_mbps=_sysfs_int(_SYS_NET / name / "speed"),
                )
            )
    return interfaces


def rdma_devices() -> list[str]:
    """InfiniBand / RoCE devices (``mlx5_0``); MPI and NCCL use them without IP interfaces."""
    try:
        return sorted(path.name for path in _SYS_INFINIBAND.iterdir())
    except OSError:
        return []


def candidate_interfaces(interfaces: list[Interface]) -> list[Interface]:
    """Addresses worth probing: up, not loopback, not link-local; fastest links first."""
    found = [
        interface
        for interface in interfaces
        if interface.up
        and not interface.loopback
        and not ipaddress.ip_address(interface.address).is_link_local
    ]
    # Stable sort: physical before virtual, then faster first, kernel order otherwise.
    return sorted(found, key=lambda interface: (interface.virtual, -interface.speed_mbps))


def local_addresses() -> set[str]:
    """This machine's IPv4 addresses, loopback included."""
    return {interface.address for interface in local_interfaces()} | {"127.0.0.1"}
