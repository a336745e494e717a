// HTTP requests through libcurl (Note [An HTTP client from libcurl] in docs/design.md): one
// blocking request per call, each on its own handle, so that threads may call it at once.
#pragma once

#include <string>
#include <vector>

namespace accelerate::detail::http {

struct Request {
  std::string method = "GET";  // GET, POST, PATCH, PUT or DELETE
  std::string url;
  std::string body;                  // sent as it is (POST, PATCH, PUT)
  std::vector<std::string> headers;  // "Name: value"
  double timeout_s = 120;            // the whole request
  double connect_timeout_s = 10;     // reaching the server
  bool verify_tls = true;
  std::string user_password;  // "user:password" for basic authentication; empty: none
};

struct Response {
  long status = 0;     // the HTTP status; 0 when no response came
  std::string body;    // what the server sent
  std::string error;   // why no response came (curl's words, naming the URL); empty when one did

  bool ok() const { return error.empty() && status >= 200 && status < 300; }
};

/// Performs `request`; never throws for the network's faults, which come back in `error`.
Response perform(const Request& request);

/// `text` percent-encoded for a URL's query.
std::string escape(const std::string& text);

}  // namespace accelerate::detail::http
