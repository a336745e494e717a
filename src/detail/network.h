// The addresses and networks of this machine, as the kernel routes them. Torch-free: the
// launcher uses them too (Note [The launcher without LibTorch]).
#pragma once

#include <string>

namespace accelerate::detail {

/// The address of this machine that its packets to `host` leave from (the kernel's route; nothing
/// is sent). Throws naming the host when it cannot be resolved or reached.
std::string source_address_towards(const std::string& host, int port);

/// The IPv4 network, in CIDR notation ("10.0.0.0/24"), of the interface of this machine that has
/// `address`; empty when none has it.
std::string network_of_address(const std::string& address);

/// Whether `host` (an address or a name) is an IPv4 or IPv6 address of one of
/// this machine's interfaces, or a loopback address (127.0.0.0/8, ::1, or IPv4-mapped ones).
bool is_local_address(const std::string& host);

}  // namespace accelerate::detail
