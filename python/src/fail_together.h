#pragma once
// Bindings of collective calls read their Python arguments before the C++ call's agreement (agreement.h): a
// bad argument on one rank must still reach the other ranks, waiting in that agreement, or they would wait
// for a collective this rank never joins. Call fail_together in the catch block around the argument reading.
#include <exception>
#include <string>

#include <pybind11/pybind11.h>

#include "gpuops/agreement.h"

namespace gpuops::python {

/// Tells every rank of `comm` waiting in `what`'s agreement that this rank failed with the exception in
/// flight (they raise naming this rank), then rethrows it here. The GIL is released during the exchange.
[[noreturn]] inline void fail_together(dist::Communicator& comm, const std::string& what) {
  const std::exception_ptr error = std::current_exception();
  dist::Agreement agreement(what);
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {  // pybind11's own errors and Python's (error_already_set) are std::exceptions
    agreement.fail(e.what());
  } catch (...) {
    agreement.fail("an unknown error");
  }
  {
    pybind11::gil_scoped_release release;
    try {
      agreement.exchange(comm);
    } catch (...) {  // this rank's own failure comes back; the error to raise is the one in flight
    }
  }
  std::rethrow_exception(error);
}

}  // namespace gpuops::python
